#!/usr/bin/env bash
# The GPU machine's one script: use the carried build (or build), run the GPU tests, run the
# benchmarks, print the tables. Full logs go to $OUT (or /tmp/gpu_check) when set.
#   bash benchmarks/gpu_check.sh [pytest -k expression] [benchmark names...]
# Environment: BUILD=1 forces a CMake build here; SKIP_TESTS=1 / SKIP_BENCH=1 skip a half;
# TEST_FILES picks test files (default: every tests/gpu/test_*.py, one process each).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
logs=${OUT:-/tmp/gpu_check}
mkdir -p "$logs"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader

if [ "${BUILD:-0}" = 1 ] || [ ! -f build/libjax_w4a4.so ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$(command -v python3)" \
    > "$logs/build.log" 2>&1 && ninja -C build >> "$logs/build.log" 2>&1 || { tail -40 "$logs/build.log"; exit 1; }
fi
export JAX_W4A4_LIBRARY=$PWD/build/libjax_w4a4.so
python3 -c "import jax, jax_w4a4.ops as o; print('jax', jax.__version__, jax.devices(), 'targets', o.compiled_targets())"

status=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # One process per test file, all at once (their time is mostly compiling on the host's cores; together their
  # XLA pools take 80% of the GPU's memory, the rest is for their CUDA contexts): a kernel fault poisons its own
  # CUDA context, not the other files' runs.
  # The tests fill XLA's pool with NaN poison; CUDA graphs would then have no memory to instantiate in.
  # TEST_XLA_FLAGS="" runs them with XLA's default command buffers (checks CUDA-graph capture).
  # No autotuning: the tests compile a reference dot per shape, and only our kernels are under test.
  start=$SECONDS
  pids=()
  test_files=(${TEST_FILES:-tests/gpu/test_*.py})
  pool_fraction=$(python3 -c "print(round(0.8 / ${#test_files[@]}, 3))")
  for test_file in "${test_files[@]}"; do
    name=$(basename "$test_file" .py)
    XLA_FLAGS="${TEST_XLA_FLAGS---xla_gpu_enable_command_buffer=} --xla_gpu_autotune_level=0" \
    XLA_PYTHON_CLIENT_MEM_FRACTION=$pool_fraction timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu "$test_file" \
      --maxfail=4 -p no:cacheprovider -rf ${1:+-k "$1"} > "$logs/$name.log" 2>&1 &
    pids+=("$!:$name")
  done
  for entry in "${pids[@]}"; do
    wait "${entry%%:*}"
    code=$?
    [ $code -eq 0 ] || status=$code
    name=${entry#*:}
    echo "== $name (exit $code)"; grep -E "^(FAILED|ERROR)|passed|failed|^E  .{0,200}$" "$logs/$name.log" | head -12
  done
  echo "== GPU tests: $((SECONDS - start)) s"
fi
shift || true
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  # torch and CUDA graphs need memory beside XLA's pool. XLA's default command buffers (CUDA graphs)
  # stay on: that is what a user's jit gets, and act_quant / w4a4_gemm are captured in them.
  export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5} XLA_FLAGS=${BENCH_XLA_FLAGS-}
  for bench in ${@:-act_quant w4a4 w4a16}; do
    args=""  # "name:args" passes arguments, e.g. w4a4:--only=decode
    [[ $bench == *:* ]] && args=${bench#*:} && bench=${bench%%:*}
    start=$SECONDS
    timeout "${BENCH_TIMEOUT:-200}" python3 "benchmarks/bench_${bench}.py" $args > "$logs/bench_${bench}.log" 2>&1
    echo "== bench_${bench} (exit $?, $((SECONDS - start)) s)"; grep -v "^WARNING\|^I0000\|^W0000" "$logs/bench_${bench}.log" | tail -40
  done
fi
echo "== gpu_check.sh: $SECONDS s in all (target: under 480)"
exit "$status"
