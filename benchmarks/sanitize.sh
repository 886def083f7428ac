#!/usr/bin/env bash
# compute-sanitizer over small GPU test cases that reach every kernel instance: act_quant (row blocks, K
# splits), w4a16 (narrow CTAs in runs of 1 atom, their K-split clusters, split-K, mma.sync and wgmma token tiles, act-order gather,
# whole-SM CTAs planned for 8 SMs)
# and w4a4 (the 8- to 128-token tiles, stream-K, the 2-CTA cluster with a phantom column tile, the expanded
# weights of long prefills on 128- and 256-token tiles, the fused linear's GEMM launched while act_quant runs).
# The large shapes stay out: instrumented kernels run 10-100x slower. Run on the GPU machine with
# build/libjax_w4a4.so built or carried:
#   bash benchmarks/sanitize.sh [tools...]      (default: memcheck; also racecheck, synccheck, initcheck)
#   SANITIZE_ONLY=regex runs only the groups whose "op:selection" line matches (grep -E), e.g. 'w4a16.*split_k'
# One process per case group, so a crash ends one group only. XLA's default (pooled) allocator: memcheck then
# sees shared-memory bounds, misaligned accesses, hardware exceptions and accesses outside XLA's pool, not a
# buffer overrunning into its neighbour in the pool (XLA_PYTHON_CLIENT_ALLOCATOR=platform gives every buffer
# its own cudaMalloc and bounds). compute-sanitizer 2025.3.1 itself crashes at times (SIGSEGV, no report, at
# varying tests of varying groups: session 17 in benchmarks/NOTES.md), so a crashed group says nothing either
# way: the script then runs the group's cases one process each. racecheck reports hazards on w4a4_gemm's scale copies against the consumers' loads: a
# pattern the tool does not follow (a warp's loads released by one lane after __syncwarp), which
# benchmarks/racecheck_probe.cu reproduces in miniature on correct code (session 46). Exit status: non-zero
# if a tool reported an error, a test failed or the sanitizer crashed (139). Logs in $OUT (or /tmp/sanitize).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export JAX_W4A4_LIBRARY=${JAX_W4A4_LIBRARY:-$PWD/build/libjax_w4a4.so}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0"
logs=${OUT:-/tmp/sanitize}
mkdir -p "$logs"

# memcheck 2025.3.1 crashes on these two every time (16-token narrow32 clusters with zero points, since runs of
# 1 atom); racecheck, synccheck and initcheck pass them (benchmarks/NOTES.md, session 36): a group of their own
MEMCHECK_CRASHERS="1024x4096-g32-m16 or 512x4096-g64-m16"
# test file : pytest -k expression (one process each)
CASE_GROUPS=(
  "act_quant:(test_matches_reference and K3072 and (M1- or M7- or M333-)) or test_k_multiple_of_64 or test_split_counters_are_rearmed or (test_rank_buckets and 333 and int4) or (test_decode_split_on_idle_sms and int4)"
  "w4a16_forms:test_narrow_ctas"
  "w4a16_forms:test_narrow_k_split_clusters and not 28672 and not 20480 and not 18944 and not 12288 and not 11008 and not ($MEMCHECK_CRASHERS)"
  "w4a16_forms:test_narrow_k_split_clusters and ($MEMCHECK_CRASHERS)"
  "w4a16_gemm:test_every_token_tile"
  "w4a16_gemm:test_rows_not_a_multiple or test_leading_dims_and_small_split_k"
  "w4a16_gemm:test_every_group_size_with_act_order and (32 or 64)"
  "w4a16_gemm:test_every_group_size_with_act_order and (128 or -1)"
  "w4a16_forms:test_whole_sm_ctas_planned_for_few_sms"
  "w4a4_gemm:M1-N3072 or M7-N128 or M13-N4096 or M9-N128"
  "w4a4_gemm:M20-N28672 or M40-N4096"
  "w4a4_gemm:M64-N128"
  "w4a4_gemm:M150-N3072 or M333-N128"
  "w4a4_gemm:M1100-N1536"
  "w4a4_gemm:M800-N3072 or M1000-N4096"
  "w4a4_gemm:test_w4a4_linear and (M7- or M16-N128 or M20-N4096 or M200- or few_sms)"
)

# sanitize TOOL NAME LOG PYTEST_ARGS...: one sanitized pytest process; prints its line, returns its exit status.
sanitize() {
  local tool=$1 name=$2 log=$3; shift 3
  timeout "${SANITIZE_TIMEOUT:-120}" compute-sanitizer --tool "$tool" --error-exitcode 97 --print-limit 20 \
    python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > "$log" 2>&1
  local code=$?
  local summary tests
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1 | sed 's/=* *//')
  tests=$(grep -E "[0-9]+ (passed|failed)" "$log" | tail -1)
  [ $code -eq 139 ] && summary="compute-sanitizer crashed (SIGSEGV) after $(grep -o '^[.FEsx]*' "$log" | tr -d '\n' | wc -c) tests"
  echo "== $tool $name (exit $code): ${summary:-no summary} | ${tests:-no pytest summary}"
  [ $code -eq 0 ] || [ $code -eq 139 ] || grep -E "^=+ (Invalid|Error|Race|Barrier|Warning)|^=+ +at |FAILED" "$log" | head -12
  return $code
}

compute-sanitizer --version | tail -1
status=0
for tool in ${@:-memcheck}; do
  for group in "${CASE_GROUPS[@]}"; do
    [ -z "${SANITIZE_ONLY:-}" ] || grep -qE -- "$SANITIZE_ONLY" <<< "$group" || continue
    op=${group%%:*} selection=${group#*:} file="tests/gpu/test_${group%%:*}_gpu.py"
    log="$logs/${tool}_${op}_$(echo "$selection" | tr -c 'A-Za-z0-9' '_' | cut -c1-60).log"
    sanitize "$tool" "$op [$selection]" "$log" "$file" -k "$selection"
    code=$?
    if [ $code -eq 139 ]; then
      # The sanitizer's own crash ended the group's process: its cases again, one process each (session 50:
      # groups that crashed twice ran clean case by case).
      code=0
      for case_id in $(python3 -m pytest -q --collect-only -m gpu -p no:cacheprovider "$file" -k "$selection" | grep "::"); do
        sanitize "$tool" "  $case_id" "$logs/${tool}_${op}_$(echo "${case_id#*::}" | tr -c 'A-Za-z0-9' '_' | cut -c1-120).log" "$case_id"
        case_code=$?
        [ $case_code -eq 0 ] || code=$case_code
      done
    fi
    [ $code -eq 0 ] || status=$code
  done
done
exit "$status"
