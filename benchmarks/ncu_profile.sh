#!/usr/bin/env bash
# Nsight Compute profile of one steady-state launch per case (benchmarks/profile_kernels.py), at the
# card's own clocks. Reports go to $OUT (or /tmp/ncu); a short digest is printed.
#   bash benchmarks/ncu_profile.sh [case ...]     (default: every case)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} JAX_W4A4_LIBRARY=${JAX_W4A4_LIBRARY:-$PWD/build/libjax_w4a4.so}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" XLA_PYTHON_CLIENT_PREALLOCATE=false
logs=${OUT:-/tmp/ncu}
mkdir -p "$logs"
declare -A KERNEL=([w4a4_prefill]=W4A4GemmKernel [w4a4_decode]=W4A4GemmKernel [act_quant]=ActQuantKernel
                   [w4a16_m1]=W4a16GemmKernel [w4a16_m16]=W4a16GemmKernel)
if [ "${1:-}" = chain ]; then  # every kernel of the benchmark chain, durations only
  timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum python3 benchmarks/profile_kernels.py w4a4_chain \
    > "$logs/ncu_chain.txt" 2>&1
  grep -E "^  [A-Za-z_].*\(|gpu__time_duration" "$logs/ncu_chain.txt" | paste - - | awk '{print $1, $(NF)}' | tail -40
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
