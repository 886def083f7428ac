#!/usr/bin/env bash
# Nsight Compute profile of one steady-state launch per case (benchmarks/profile_kernels.py), at the
# card's own clocks. Reports go to $OUT (or /tmp/ncu); a short digest is printed.
#   bash benchmarks/ncu_profile.sh [case ...]     (default: every case)
#   bash benchmarks/ncu_profile.sh stalls case... (instructions executed and stall reasons per issue)
#   bash benchmarks/ncu_profile.sh durations case... (duration of every launch of the cases' kernels; a long
#                                                     w4a4 prefill is two: ExpandWeightsKernel, then the GEMM)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} JAX_W4A4_LIBRARY=${JAX_W4A4_LIBRARY:-$PWD/build/libjax_w4a4.so}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" XLA_PYTHON_CLIENT_PREALLOCATE=false
logs=${OUT:-/tmp/ncu}
mkdir -p "$logs"
declare -A KERNEL=([w4a4_prefill]=W4A4GemmKernel [w4a4_decode]=W4A4GemmKernel [w4a4_decode16]=W4A4GemmKernel [act_quant]=ActQuantKernel
                   [w4a16_m1]=W4a16GemmKernel [w4a16_m16]=W4a16GemmKernel [w4a16_m32]=W4a16GemmKernel
                   [w4a16_m64]=W4a16GemmKernel [w4a16_8k_m1]=W4a16GemmKernel
                   [w4a16_8k_m16]=W4a16GemmKernel)
if [ "${1:-}" = chain ]; then  # every kernel of the benchmark chain, durations only
  timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum python3 benchmarks/profile_kernels.py w4a4_chain \
    > "$logs/ncu_chain.txt" 2>&1
  grep -E "^  [A-Za-z_].*\(|gpu__time_duration" "$logs/ncu_chain.txt" | paste - - | awk '{print $1, $(NF)}' | tail -40
  exit 0
fi
if [ "${1:-}" = durations ]; then  # every launch of the cases' kernels, duration only (cold L2 each)
  shift
  timeout 300 ncu --clock-control none --cache-control all -k "regex:W4A4|W4a16|ActQuant|ExpandWeights" \
    --metrics gpu__time_duration.sum python3 benchmarks/profile_kernels.py "$@" > "$logs/ncu_durations.txt" 2>&1
  grep -E "^  [A-Za-z_].*\(|gpu__time_duration" "$logs/ncu_durations.txt" | paste - - |
    sed -E 's/^ +(void )?//; s/\(jax_w4a4::[^)]*\)//; s/, Context.*gpu__time_duration.sum//; s/  +/ /g'
  exit 0
fi
if [ "${1:-}" = stalls ]; then  # executed instructions and the stall reasons per issued instruction
  shift
  reasons=(barrier long_scoreboard short_scoreboard math_pipe_throttle mio_throttle wait not_selected selected
           dispatch_stall lg_throttle branch_resolving no_instruction drain imc_miss membar sleeping misc)
  metrics=gpu__time_duration.sum,smsp__inst_executed.sum,smsp__cycles_active.avg
  for r in "${reasons[@]}"; do metrics+=",smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"; done
  for name in "$@"; do
    timeout 150 ncu --clock-control none --cache-control all -k "regex:${KERNEL[$name]}" --launch-skip 1 \
      --launch-count 1 --metrics "$metrics" python3 benchmarks/profile_kernels.py "$name" > "$logs/stalls_$name.txt" 2>&1
    echo "== $name stalls (exit $?)"
    grep -E "gpu__time|inst_executed|cycles_active|stalled" "$logs/stalls_$name.txt" |
      sed -E 's/(smsp__average_warps_issue_stalled_|smsp__|gpu__)//; s/_per_issue_active.ratio//' |
      awk '{print $1 "=" $NF}' | paste -sd' '
  done
  exit 0
fi
for name in ${@:-w4a4_prefill w4a4_decode act_quant w4a16_m1 w4a16_m16}; do
  timeout 150 ncu --clock-control none --cache-control all -k "regex:${KERNEL[$name]}" --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    python3 benchmarks/profile_kernels.py "$name" > "$logs/ncu_$name.txt" 2>&1
  echo "== $name (exit $?)"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Registers Per|Grid Size|Block Size|Achieved Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Executed Ipc A|Dynamic Shared|Stall|L2 Hit" \
    "$logs/ncu_$name.txt" | sed 's/  */ /g' | head -24
done
