#!/usr/bin/env bash
# The GPU machine's one script: use the carried build (or build), run the GPU tests, run the
# benchmarks, print the tables. Full logs go to $OUT (or /tmp/gpu_check) when set.
#   bash benchmarks/gpu_check.sh [pytest -k expression] [benchmark names...]
# Environment: BUILD=1 forces a CMake build here; SKIP_TESTS=1 / SKIP_BENCH=1 skip a half.
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
  python3 -m pytest -q -m gpu tests/gpu -x -p no:cacheprovider ${1:+-k "$1"} 2>&1 | tee "$logs/gpu_tests.log" | tail -25
  status=${PIPESTATUS[0]}
fi
shift || true
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  for bench in ${@:-act_quant w4a4 w4a16}; do
    timeout 240 python3 "benchmarks/bench_${bench}.py" 2>&1 | tee "$logs/bench_${bench}.log"
  done
fi
exit "$status"
