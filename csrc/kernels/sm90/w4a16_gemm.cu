// w4a16_gemm (sm_90a, MARLIN class): Y (M, N) = X (M, K) · Ŵᵀ + β with Ŵ[n,k] = (q[n,k] − z[n,g]) · s[n,g],
// X bf16/fp16, q uint4 prepacked offline (jax_w4a4/formats/w4a16_layout.py), fp32 accumulation.
// Byte contract: docs/layouts.md, section w4a16_gemm. Built for decode: M = 1..64 per CTA, the time is
// the time to stream the 4-bit weights once from HBM.
//
// Orientation. W is the MMA's A operand, X the B operand, so 8 tokens fill an MMA (16 in MARLIN's
// orientation); fp32 accumulation. Each warp dequantizes its own m16 tiles into A fragments in the
// mma.sync m16n8k16 layout, which is also a warp's 16-row slice of a register A operand of wgmma.
// The X tile sits in shared memory K-major with the 128-byte swizzle. By the token tile:
//  * 32-64 tokens: wgmma m64nNk16, N = the token tile, B read by the tensor cores from shared memory.
//    Tile t of the four warps of a warpgroup forms one wgmma (each warp gets its slice of D back), so
//    the MMAs per k16 step and warp are the m16 tiles whatever the tokens, and no X fragment passes
//    through registers (mma.sync took tiles x token tiles MMAs and an ldmatrix per token tile;
//    measured at 64 tokens: 140 -> 102 us at 28672 x 8192, 47.4 -> 34.4 us at 8192², session 10).
//  * 8 and 16 tokens: mma.sync m16n8k16, one MMA per m16 tile and token tile, B fragments from ldmatrix
//    (the swizzled addresses). A warp owns 4 m16 tiles here, and wgmma with 4 tiles cost 1 x 28672 x 8192
//    45.4 -> 48.2 us and 4096² 8.8 -> 10.4 us (session 10): 128 registers hold one step's A fragments in
//    flight, so every k16 step waited for its wgmmas. At 16 tokens mma.sync with 4 tiles and raw codes
//    against wgmma with 2: 55.1 -> 49.4 us at 28672 x 8192 (session 12; without memory waits 50.1 us:
//    the wgmma tiles were compute-bound, at twice the warp-atoms and their bookkeeping). Whole-SM CTAs at 16
//    tokens stay on mma.sync with 8 tiles a warp: wgmma with 4 there cost 46.6 -> 53.7 us (session 30). At
//    N = 16 a wgmma does not issue more MACs a cycle than mma.sync: both ~1,300 per SM, 64% of the dense peak,
//    and ~680 for wgmma steps that first dequantize their A registers (benchmarks/tensor_pipe_probe.cu, session 33).
//
// Numerics: exact Ŵ. No weight is rounded (MARLIN rounds (q − z)·s to bf16, a 2^-9 relative error per
// weight); the only roundings are fp32 accumulation and the final cast, like the reference.
//  * fp16, and bf16 beyond 16 tokens: the A fragment is q − z, exact; the MMAs of one group accumulate
//    Σ x·(q − z) into fp32 partials, promoted at the group's end with one fp32 FMA per element:
//    acc += s · partial.
//  * bf16 up to 16 tokens ("raw codes"): the A fragment is the raw code 128 + q, exact; the MMAs
//    accumulate Σ x·(128 + q), and column-sum MMAs (A = X, B = ones) S = Σ x of each token, both in fp32.
//    Promotion: acc += s · fma(−(128 + z), S, partial) = s · Σ x·(q − z), the difference rounded once.
//    S comes from one more MMA per two k16 steps and token tile with B = ones (ColumnSums).
//    The partials carry the offset 128·S, so their fp32 rounding error is up to ~200 times that of
//    Σ x·(q − z): ~1e-6 of the result, ~2e-5 for all-positive X if the tensor cores truncate (a CPU
//    emulation). It grows with the columns per partial, so raw codes promote at least every 128 columns,
//    per-channel scales too (a whole 8192-column partial: ~2e-3 in the same emulation).
//
// Work split. A CTA owns `warps` warps of W rows (up to 16 tokens a warp owns four m16 tiles = 64 rows,
// so the X fragments, the loop and the barrier serve twice the weights; beyond, two tiles in wide CTAs, since
// the accumulators fill the registers; whole-SM CTAs twice the wide CTA's, below) and a K range (split-K over
// `splits` CTAs), chosen on the host so one wave covers the 132 SMs (x 2 CTAs per SM up to 16 tokens). The CTA
// launches whole warpgroups (and a producer warpgroup: Pipelines); the warps past `warps` own no rows and only join
// the wgmmas. Tokens beyond 64 run as more CTAs along gridDim.y (one 64-token block each). Split-K partials go to
// the workspace in MMA fragment order; for each row warp, the last of its splits to arrive (an arrival counter per
// tile and row warp, common/arrival_counters.h, which re-arms itself: no memset) sums that warp's rows in split order —
// deterministic, no host sync, CUDA-graph safe. Per warp, not per CTA: a CTA's warps end their loops up to
// microseconds apart, and the tile's sum and epilogue spread over the warps of its splits (session 32, us at M = 1
// / 16: 28672 x 8192 36.0 / 41.5-41.8 -> 35.3-35.4 / 40.9-41.3, 8192 x 28672 (16 splits) 46.3-46.4 -> 45.1 at 16).
// Whole-SM CTAs (long splits: the planner's rule in w4a16_gemm_plan.h): the same code with one CTA per SM. At one
// token tile up to 16 row warps of 4 m16 tiles, where a wide plan would put two CTAs of up to 8 (1 x 28672 x 8192:
// 128 CTAs of 14 warps, not 256 of 7): the pair's warps share one ring and end together. At the 16- and 32-token
// tiles up to 8 row warps with twice the wide CTA's tiles (8 m16 tiles on mma.sync, 4 on wgmma; 202-254 registers a
// thread): the X fragments or tile, the stage waits and the loop serve twice the weights (32 x 28672 x 8192: 74.3
// -> 61.3 us, session 29; 16 x 28672 x 8192: 46.5 -> 44.2 us, session 30). At 32 tokens a CTA may have 7 row warps;
// at 16 an 896-row CTA is 8 warps of 7 tiles (kWhole7, 190-220 registers), not 7 of 8: the eighth launched warp
// would run a row warp's MMAs on no rows, and at 16 tokens an SM's time follows its busiest scheduler's MMAs (16 x
// 28672 x 8192: 43.6-43.9 -> 41.7-41.9 us, session 31).
// Narrow CTAs (up to 16 tokens, layers of up to num_sms x 64 rows, where the planner in w4a16_gemm_plan.h
// picks them: a narrow CTA streams about as much as the wide plan's busiest SM and pays no split-K round
// trips): one CTA per SM owns one warp's 64 rows (narrow32: 32, two m16 tiles, for layers of up to 132 x 32
// rows with K <= 8192, twice the CTAs) and all of K. Roles: k-lanes (up to 8 warps, 12 at 16 tokens, the
// same rows, each computing every k_lanes-th run of atoms: a stage of 4, or 1 with K <= 8192 or 9-16 tokens, so
// that four lanes share a stage and the last one is computed in a quarter of the time) and a producer warp; at the
// end the lanes' accumulators are added in lane order through shared memory (deterministic), and k-lane 0 stores. No
// workspace, no arrival counter. From 8 tokens the unsplit CTAs of a launch that fills the SMs start K in 8
// phases (W4a16Launch::k_phases: stage offsets by row tile, wrapping around), so that they do not all read the
// same X stage from L2 at once (16 x 8192²: 17.4 -> 15.4-15.6 us, session 39). K-split clusters (where fewer
// row tiles than SMs: W4a16Launch::splits): the CTAs of a row tile form one cluster of 2 or 4, each with its
// share of K in 128-column granules; after the lanes' sum, k-lane 0 of rank r > 0 stores its accumulators into
// rank 0's cluster-sum slot r - 1 (st.async, counted on rank 0's mbarrier, which the cluster barrier after
// __syncthreads published) and exits; rank 0 waits for the bytes, adds the slots in rank order (deterministic)
// and stores Y.
//
// Pipelines (no __syncthreads in the loop). Who produces (HasProducerWarpgroup in w4a16_gemm_plan.h):
//  * one-CTA-per-SM wide and whole-SM CTAs (but kWhole at 16 tokens): a producer warpgroup past the computing
//    ones, whose first warp's lane 0 issues the ring and whose other warps exit; it gives 128 of its registers a
//    thread to the computing warpgroups (setmaxnreg.dec 40 / .inc 232: 384 threads leave ptxas 168 at launch).
//    A lone producer warp (288 threads) does not work: ptxas allocates registers as for 384 threads, and an .inc
//    finds nothing in the pool that no warpgroup gave back (it waits forever: session 51's first try hung).
//    Until session 51 the producer lane sat in the last computing warp and refilled a slot before computing
//    each atom: its warp started every atom late by the empty-barrier wait for the CTA's slowest warp and three
//    TMA issues, and with wgmma its three warpgroup siblings waited for it at the atom's first wgmma (ncu: ~9% of
//    the 32-token stall samples there). Measured, us at M = 1 / 16 / 32 / 64 on 28672 x 8192: 35.8 / 41.5 / 60.9 /
//    86.8 -> 35.4 / 40.1 / 55.0 / 71.8 (benchmarks/NOTES.md, session 51);
//  * two-CTA-per-SM wide CTAs (8 and 16 tokens): still lane 0 of the last warp, which also computes (a producer
//    warpgroup in each CTA would leave the computing warps ~104 registers a thread, against the 126-128 they use);
//  * narrow CTAs: a producer warp beside the k-lanes.
//  * main ring, kStages deep, one stage = one 64-wide K atom (kStages - 1 atoms in flight while one is
//    computed; with a producer warpgroup kStages), filled by TMA: the producer issues per stage the weights of all
//    the CTA's m16 tiles (16 rows x 64 k each in fragment order, contiguous row blocks: one box,
//    L2::evict_first: read exactly once), the X tile (one box into 128-byte rows with the 128-byte
//    swizzle, the wgmma B operand; rows past M arrive as zeros; narrow: one 3-D box of the stage's atoms
//    with only the M token rows, see below), and the scales and zero points of the
//    atom's groups for the CTA's rows (one box each from their (K/G, N) kernel layout), all counted by
//    the stage's full mbarrier. Every warp releases the stage on its empty mbarrier once its reads are
//    done (wgmma: the atom's wgmmas retired); the producer (warp) refills a slot once its computing warps
//    have released it (an inline producer lane: the slot of atom i - 1, before it computes atom i). The wgmmas
//    read the TMA-written stage directly: no proxy fence.
//    (Until session 10 every thread cp.async'ed its own fragment words and X chunks, with a __syncthreads
//    per atom, and fetched the scales with 2-byte loads of an (N, K/G) layout into a double-buffered
//    table. Measured at 1 x 28672 x 8192: 45.7 -> 44.0 us with the TMA ring, -> 38.8-39.5 us with the
//    scales in the stage; 16 tokens 63.7 -> 54.8 us; benchmarks/NOTES.md, session 11.)
//  * compute: per k16 step, lop3 + fma dequantization of every m16 tile (the 0x6400 fp16 / 0x4300 bf16
//    exponent tricks; no lookup tables; bf16 raw codes: lop3 only), then the MMAs. wgmma: one per tile,
//    commit, and the previous step retired (wait_group 1) before the next writes its A registers;
//    every group end retires all and promotes. mma.sync (8, 16 tokens): an ldmatrix per two k16 steps and
//    token tile, one MMA per tile and token tile (raw codes: plus the column sums), promotion at group ends.
//  * epilogue: + β in fp32, cast, store (split-K: fragment-order partials of the lanes that hold a token
//    < M, a row warp's arrival counter, ordered reduction).
// Act-order: the weights are stored in argsort(g_idx) order; LaunchGemm first gathers X's columns in
// that order (a small kernel, into the workspace) and checks g_idx against the stored permutation: a mismatch
// turns the affected columns into NaN, so a wrong g_idx can never give a plausible wrong answer.
//
// Shared memory per CTA (W4a16Plan in w4a16_gemm_plan.h, static_assert'ed against the SM's 228 KB
// shared by CtasPerSm CTAs, less the driver's 1 KB per CTA; python -m jax_w4a4.budget prints it):
//   kStages x (weights of one atom + M_tile x 128 B of X + 2 groups x rows x 3 B of scales and zero
//   points + 16 B of mbarriers) + 1 KB to align the base to the swizzle atom
//   = 103504 B (M_tile 8: 8 warps x 4 tiles, 5 stages, 2 CTAs/SM), 108624 B (16: 8 warps x 4 tiles,
//     5 stages, 2 CTAs/SM), 222464 B (32: 16 stages, 1 CTA/SM), 216256 B (64: 12 stages, 1 CTA/SM);
//   whole-SM (1 CTA/SM): 200784 B (M_tile 8: 16 warps x 4 tiles, 5 stages of 39936 B), 205904 B (16: 8 warps
//     x 8 tiles, 5 stages of 40960 B; kWhole7: 8 x 7, 6 stages of 36096 B, 217696 B), 213136 B (32: 8 warps x 4
//     tiles, 9 stages of 23552 B);
//   narrow (stages of 4 atoms of 64 rows, 1 CTA/SM): 228624 B (M_tile 8: 16 stages of 13824 B),
//     228560 B (16: 12 stages of 17920 B), each with 6160 / 12304 B of cluster sums (3 slots of a warp's
//     accumulators and their mbarrier) past the ring; the lanes' sums reuse the ring.
//
// Measured limits (benchmarks/NOTES.md, session 11): the ring alone (every warp releases each stage
// unread) streams 1 x 28672 x 8192 in 32.1 us (3.78 TB/s) and 8192² in 14.4 us; with the arithmetic
// 38.8-39.5 us and 17.1 us. ncu (cold L2): 41.4 us, 16.7 M warp-instructions, 1.1 eligible warps per
// scheduler of 3.6 active, 7.1 cycles per issued instruction: latency-bound (the dequantization chain
// and the stage waits), not issue-bound. With the ring's waits removed (a timing probe, session 12) the
// arithmetic alone takes 31.2 us, about as long as the stream: the kernel pays wherever either waits
// for the other. 16 tokens: 49.4 us (session 12). With the zero points a template parameter (session 13):
// 37.3-37.7 us at 1 token, 46.6 at 16.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/arrival_counters.h"
#include "common/ptx.h"
#include "common/tma.h"
#include "common/wgmma.h"
#include "kernels/sm90/w4a16_gemm.h"
#include "kernels/sm90/w4a16_gemm_plan.h"

namespace jax_w4a4::sm90::w4a16 {
namespace {

// ------------------------------------------------------------------------------------------ geometry

constexpr int kPerChannelShift = 30;              // k < 2^30: every atom is in group 0
constexpr int kRawCodesMaxPromotionCols = 128;    // raw-code partials carry an offset: see Numerics

template <int kMTiles, W4a16Form kForm>  // n8 tiles of tokens; how the CTAs hold an SM (w4a16_gemm_plan.h)
struct Config {
  static constexpr bool kNarrow = IsNarrow(kForm);
  static constexpr W4a16Plan kPlan = SolveW4a16Plan(kMTiles, kForm);
  static constexpr int kCtasPerSm = kPlan.ctas_per_sm;
  static constexpr bool kProducerWarpgroup = HasProducerWarpgroup(kMTiles, kForm);  // narrow's producer is in max_warps
  static constexpr int kMaxThreads = kPlan.max_warps * 32 + (kProducerWarpgroup ? kProducerWarpgroupThreads : 0);
  // 384 threads (two computing warpgroups and the producer's) leave 168 registers a thread at launch: the producer
  // warpgroup gives 128 of them back and the computing ones take them.
  static constexpr bool kShiftRegisters = kProducerWarpgroup && kMaxThreads == 384;
  static constexpr int kProducerRegisters = 40;
  static constexpr int kComputeRegisters = budget::ComputeRegistersBesideProducer(
      kMaxThreads, kCtasPerSm, kProducerWarpgroupThreads, kProducerRegisters);
  static constexpr int kBlockM = kPlan.block_m;   // tokens per CTA
  static constexpr int kTilesPerWarp = kPlan.tiles_per_warp;
  static constexpr int kWarpRows = kTilesPerWarp * kAtomRows;
  static constexpr int kBlockRows = kPlan.block_rows;  // with all row warps
  static constexpr int kStageWeightBytes = kPlan.stage_weight_bytes;
  static constexpr int kStageXBytes = kPlan.stage_x_bytes;
  static constexpr int kStageScaleBytes = kPlan.stage_scale_bytes;
  static constexpr int kStageAtoms = kPlan.stage_atoms;
  static constexpr int kRowBlockBytes = kStageAtoms * kAtomBytes;  // a stage's weights of one m16 tile
  static constexpr int kAtomXBytes = kBlockM * kXRowBytes;         // a stage's X tile of one atom
  static constexpr int kStageGroups = kStageAtoms * kMaxGroupsPerAtom;
  static constexpr int kStages = kPlan.stages;
  static constexpr int kWeightRingOffset = 0;
  static constexpr int kXRingOffset = kWeightRingOffset + kStages * kStageWeightBytes;
  // A scale stage: the scales of the atom's groups, then their zero points (each group's rows contiguous).
  static constexpr int kScaleRingOffset = kXRingOffset + kStages * kStageXBytes;
  static constexpr int kStageZerosOffset = kStageGroups * kBlockRows * kScaleBytes;
  static constexpr int kBarrierOffset = kScaleRingOffset + kStages * kStageScaleBytes;  // full[kStages], empty[kStages]
  // Narrow: the cluster sums, slot r - 1 for rank r of a K-split cluster (a warp's accumulators as float4, lane
  // fastest), then their mbarrier.
  static constexpr int kWarpSumBytes = WarpAccumulatorBytes(kMTiles, kForm);
  static constexpr int kClusterSumOffset = kBarrierOffset + kPlan.barrier_bytes;
  static constexpr int kClusterBarrierOffset = kClusterSumOffset + (kMaxNarrowCluster - 1) * kWarpSumBytes;
  // + the slack that aligns the dynamic base to the 1 KB swizzle atom
  static constexpr int kSmemBytes =
      kBarrierOffset + kPlan.barrier_bytes + kPlan.cluster_sum_bytes + budget::kSwizzledAlign;

  static_assert(kBlockM <= kMaxTokensPerBlock);
  static_assert(!kNarrow || kMTiles <= kMaxMmaSyncMTiles, "narrow CTAs run the mma.sync tiles");
  static_assert(HasForm(kMTiles, kForm), "an instance the planner can pick");
  static_assert(kPlan.fits(), "shared memory budget: the ring needs kMinStages with kCtasPerSm CTAs per SM");
  static_assert(!kShiftRegisters || (kCtasPerSm == 1 && kComputeRegisters == 232),
                "setmaxnreg stays inside the CTA's launch pool: 12 x 168 = 4 x 40 + 8 x 232 registers a lane");
  static_assert(kStageScaleBytes == kStageZerosOffset + kStageGroups * kBlockRows * kZeroBytes);
  static_assert(kStageWeightBytes == kBlockRows / kAtomRows * kRowBlockBytes);
  static_assert(kStageXBytes == kStageAtoms * kAtomXBytes);
  static_assert(kSmemBytes == kPlan.total_bytes, "the layout is the plan");
  static_assert(kXRingOffset % budget::kSwizzledAlign == 0 && kStageXBytes % budget::kSwizzledAlign == 0,
                "every X stage starts a 128-byte-swizzle atom (8 rows x 128 B): the wgmma descriptor's base");
  static_assert(kScaleRingOffset % budget::kBulkAlign == 0 && kStageScaleBytes % budget::kBulkAlign == 0 &&
                    kStageZerosOffset % budget::kBulkAlign == 0,
                "TMA destinations of the scales and zero points");
  static_assert(kBarrierOffset % budget::kMbarrierBytes == 0, "aligned mbarriers");
  static_assert(kPlan.barrier_bytes == 2 * kStages * budget::kMbarrierBytes, "a full and an empty barrier per stage");
  static_assert(kPlan.cluster_sum_bytes ==
                    (kNarrow ? kClusterBarrierOffset - kClusterSumOffset + 2 * budget::kMbarrierBytes : 0),
                "narrow: the cluster sums and their barrier");
  static_assert(kPlan.lane_sum_bytes == (kNarrow ? (kPlan.max_warps - 2) * kWarpSumBytes : 0) &&
                    kPlan.lane_sum_bytes <= kBarrierOffset,
                "narrow: the k-lanes' sums (a warp's accumulators per lane past 0) reuse the ring");
  static_assert(kClusterSumOffset % 16 == 0 && kClusterBarrierOffset % budget::kMbarrierBytes == 0,
                "16-byte st.async slots, an aligned mbarrier");
  static_assert(kStageWeightBytes + kStageXBytes + kStageScaleBytes < (1 << 20), "mbarrier tx-count range");
};

// The operands come through tensor maps (LaunchTyped): the prepacked weights as (atoms x 64 u64, n / 16
// row blocks), box (64, warps x tiles per warp); X (or its act-order gather) as (k, m), box (64, block_m),
// 128-byte swizzle; the scales (groups, n) as (n / 4 u64, groups) and the zero points (groups, n) as
// (n / 4 u32, groups), boxes of the CTA's rows and the atom's groups (kernel layout: w4a16_layout.py). Four
// scales an element: a box dimension holds at most 256 elements, and a whole-SM CTA has up to 1024 rows.
struct KernelParams {
  const void* bias;          // (n,) or nullptr
  void* y;                   // (m, n)
  float4* partials;          // split-K partials in the workspace, or nullptr
  const int32_t* act_order_flag;  // prepacked tail flag to check (no g_idx given), or nullptr
  int m, n, k;
  int group_shift;           // log2(group_size), or kPerChannelShift: groups are powers of two or all of K
  int atoms;                 // k / 64
  int warps, n_tiles, splits;
  int k_phases;              // narrow: W4a16Launch::k_phases, a power of two (the launcher checks it and whole stages)
  int phase_atoms;           // narrow: the atoms from one phase's first stage to the next one's
  uint32_t stage_tx_bytes;   // the bytes of a stage's boxes, from the boxes LaunchTyped encodes
};

// --------------------------------------------------------------------------------------- PTX helpers


__device__ __forceinline__ uint4 LoadShared128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}

// Address of 16-byte chunk `chunk` of row `row` in an X tile of 128-byte rows at `tile` with the 128-byte
// swizzle (TMA's CU_TENSOR_MAP_SWIZZLE_128B: the chunk index is XORed with the row's index in its 8-row atom).
__device__ __forceinline__ uint32_t SwizzledX(uint32_t tile, int row, int chunk) {
  return tile + row * kXRowBytes + ((chunk ^ (row & 7)) << 4);
}

// (a & mask) | magic: one lop3.
__device__ __forceinline__ uint32_t AndOr(uint32_t a, uint32_t mask, uint32_t magic) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "r"(mask), "r"(magic));
  return r;
}

template <typename T>
__device__ __forceinline__ uint32_t Fma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  if constexpr (std::is_same_v<T, __half>) {
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  } else {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  }
  return r;
}


template <typename T>
__device__ __forceinline__ float ToFloat(T v) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(v);
  } else {
    return __bfloat162float(v);
  }
}

template <typename T>
__device__ __forceinline__ T FromFloat(float v) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(v);
  } else {
    return __float2bfloat16_rn(v);
  }
}

// ---------------------------------------------------------------------------- dequantization (bits)
//
// A fragment word holds 8 nibbles; nibbles (p, p + 4) are the two halves of A register p (row g for
// even p, row g + 8 for odd p; w4a16_layout.py).
//
// bf16: (w >> 4p) & 0x000f000f | 0x4300 gives 128 + q in each half (bf16 ulp at 128 is 1), and
//       fma(·, 1, −(128 + z)) gives q − z exactly.
//       Raw codes (mma.sync, up to 16 tokens): the MMA takes 128 + q as it is (3 shifts + 4 lop3 per 8
//       weights, no packed FMAs); the offset is removed at promotion with the column sums of X (Numerics
//       above), one MMA per two k16 steps and token tile shared by all of the warp's m16 tiles
//       (ColumnSums). With wgmma the saved FMAs did not pay (session 10: 16 tokens 63.7 -> 63.9 us): the
//       wgmma tiles keep them.
//       (Tried in session 3: subtracting (128 + z) with one more MMA per k16 step and m16 tile into the
//       tile's own accumulator. Slower: it doubled every accumulator's MMA chain and the tensor pipe
//       throttled issue; benchmarks/NOTES.md.)
// fp16: w & 0x000f000f | 0x6400 gives 1024 + q (ulp 1); w & 0x00f000f0 | 0x6400 gives 1024 + 16 q,
//       and fma(·, 1/16, −(64 + z)) = q − z exactly: four registers from one shift. Rows g use the
//       low-nibble path, rows g + 8 the high-nibble one, so each row has one fixed subtrahend form.
// The subtrahends −(magic + z) are built at every group start from the stage's zero points (8 without
// them); raw codes build −(128 + z) at promotion.

// −(magic + z) in both halves, for a row in the lower (rows 0..7) or upper (8..15) half of its m16 tile.
template <typename T>
__device__ __forceinline__ uint32_t NegatedSubtrahend(uint32_t zero, bool upper_rows) {
  if constexpr (std::is_same_v<T, __half>) {
    return upper_rows ? 0xD400D400u | ((zero << 4) * 0x10001u)   // −(64 + z), high-nibble path
                      : 0xE400E400u | (zero * 0x10001u);        // −(1024 + z), low-nibble path
  } else {
    return 0xC300C300u | (zero * 0x10001u);  // −(128 + z)
  }
}

// A fragment q − z.
template <typename T>
__device__ __forceinline__ void Dequantize(uint32_t w, uint32_t sub_lo, uint32_t sub_hi, uint32_t (&a)[4]) {
  if constexpr (std::is_same_v<T, __half>) {
    constexpr uint32_t kOne = 0x3C003C00u, kSixteenth = 0x2C002C00u, kMagic = 0x64006400u;
    const uint32_t shifted = w >> 8;
    a[0] = Fma2<T>(AndOr(w, 0x000F000Fu, kMagic), kOne, sub_lo);
    a[1] = Fma2<T>(AndOr(w, 0x00F000F0u, kMagic), kSixteenth, sub_hi);
    a[2] = Fma2<T>(AndOr(shifted, 0x000F000Fu, kMagic), kOne, sub_lo);
    a[3] = Fma2<T>(AndOr(shifted, 0x00F000F0u, kMagic), kSixteenth, sub_hi);
  } else {
    constexpr uint32_t kOne = 0x3F803F80u, kMagic = 0x43004300u;
    a[0] = Fma2<T>(AndOr(w, 0x000F000Fu, kMagic), kOne, sub_lo);
    a[1] = Fma2<T>(AndOr(w >> 4, 0x000F000Fu, kMagic), kOne, sub_hi);
    a[2] = Fma2<T>(AndOr(w >> 8, 0x000F000Fu, kMagic), kOne, sub_lo);
    a[3] = Fma2<T>(AndOr(w >> 12, 0x000F000Fu, kMagic), kOne, sub_hi);
  }
}

// bf16 A fragment of raw codes 128 + q.
__device__ __forceinline__ void RawCodesBf16(uint32_t w, uint32_t (&a)[4]) {
  constexpr uint32_t kMagic = 0x43004300u;
#pragma unroll
  for (int p = 0; p < 4; ++p) a[p] = AndOr(w >> (4 * p), 0x000F000Fu, kMagic);
}

// Raw codes: −(128 + z) as an fp32 (the bf16 subtrahend's bits widened; exact).
__device__ __forceinline__ float RawCodeOffset(uint32_t zero) { return __uint_as_float((0xC300u | zero) << 16); }

// ColumnSums: Σ x on the tensor cores (raw codes). The ldmatrix.x4 of a token tile over 32 k holds the
// B fragments {b0, b1} of k16 steps j and j + 1; taken as an A fragment as it is, row g holds token g's
// k 0..7 of both steps and row g + 8 its k 8..15. With B = ones, D[g][n] + D[g + 8][n] is Σ x of token g
// over the 32 k, in every column n: one MMA per two k16 steps, no register moves, and no token's x
// reaches another token's sum (a NaN stays in its own token).
constexpr uint32_t kOnesBf16 = 0x3F803F80u;  // bf16 1.0 in both halves

// Σ x of this lane's tokens 2c, 2c + 1 (acc's columns) from a column-sum accumulator d: token t's sum
// is d[0] + d[2] in lanes 4t..4t + 3.
__device__ __forceinline__ void TokenSums(const float (&d)[4], int lane, float (&token_sums)[2]) {
  const float row_sum = d[0] + d[2];
  token_sums[0] = __shfl_sync(0xFFFFFFFFu, row_sum, 8 * (lane % 4));
  token_sums[1] = __shfl_sync(0xFFFFFFFFu, row_sum, 8 * (lane % 4) + 4);
}

template <typename T>
__device__ __forceinline__ float ScaleToFloat(uint16_t bits) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(__ushort_as_half(bits));
  } else {
    return __uint_as_float(uint32_t{bits} << 16);
  }
}

__device__ __forceinline__ uint32_t Word(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// Token tile mt (an n8 MMA's four accumulators) of an m16 tile's fragment d[4 mt + e].
template <int kFrag>
__device__ __forceinline__ float (&TokenTile(float (&frag)[kFrag], int mt))[4] {
  return *reinterpret_cast<float(*)[4]>(&frag[4 * mt]);
}

// First group of an atom (groups are 32, 64, 128 or k wide; atoms 64): shifts, not divisions.
__device__ __forceinline__ int GroupOfAtom(int atom, int group_shift) {
  return (atom * kAtomCols) >> group_shift;
}

// ---------------------------------------------------------------------------------------- the GEMM

// kZeroPoints: zero points given (AWQ); else symmetric, z = 8. A template parameter, not a runtime flag: a
// symmetric kernel's promotions carry no zero-point loads and conversions (a third of a raw-code promotion's
// instructions). Session 13, same process: 1 x 28672 x 8192 39.1 -> 37.3-37.7 us, 16 tokens 49.4 -> 46.6.
// kLaneAtoms (narrow): the atoms of a k-lane's runs, kNarrowShortRunAtoms or a whole stage (W4a16Launch::
// lane_atoms). A template parameter too: as a runtime value it cost 1 x 8192 x 28672 36.0 -> 36.5 us (session 17).
template <typename T, int kMTiles, bool kZeroPoints, W4a16Form kForm, int kLaneAtoms>
__global__ void __launch_bounds__(Config<kMTiles, kForm>::kMaxThreads, Config<kMTiles, kForm>::kCtasPerSm)
    W4a16GemmKernel(const __grid_constant__ CUtensorMap tm_w, const __grid_constant__ CUtensorMap tm_x,
                    const __grid_constant__ CUtensorMap tm_scales, const __grid_constant__ CUtensorMap tm_zeros,
                    const __grid_constant__ KernelParams p) {
  using Cfg = Config<kMTiles, kForm>;
  constexpr bool kNarrow = Cfg::kNarrow;
  constexpr int kStages = Cfg::kStages;
  constexpr int kTiles = Cfg::kTilesPerWarp;
  static_assert(!kNarrow || Cfg::kStageAtoms % kLaneAtoms == 0, "a stage holds whole runs: run_starts / run_ends");
  // Narrow runs shorter than the widest fixed group (128 columns) split a group between k-lanes: each run then
  // starts its group (the zero points) and ends its partial (one more promotion a g128 group).
  constexpr bool kRunsSplitGroups = kNarrow && kLaneAtoms * kAtomCols < kWidestFixedGroup;
  // Up to 16 tokens mma.sync (see Orientation), beyond wgmma; bf16 on mma.sync: raw codes and column sums
  // (see the dequantization notes).
  constexpr bool kWgmma = kMTiles > kMaxMmaSyncMTiles;
  constexpr bool kRawCodes = std::is_same_v<T, __nv_bfloat16> && !kWgmma;
  extern __shared__ __align__(128) uint8_t smem_raw[];

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int launched_warps = blockDim.x / 32;  // W4a16LaunchThreads
  // Wide: warp w owns rows w (past p.warps: none) and every atom. Narrow: every warp but the last (the
  // producer's) owns the CTA's rows and is a k-lane, which computes the runs k_lane, k_lane + k_lanes, ...
  const int row_warp = kNarrow ? 0 : warp;
  const int k_lane = kNarrow ? warp : 0;
  const int k_lanes = kNarrow ? launched_warps - 1 : 1;
  constexpr bool kProducerWarp = kNarrow || Cfg::kProducerWarpgroup;  // warp compute_warps only produces
  const int compute_warps =
      launched_warps - (Cfg::kProducerWarpgroup ? kProducerWarpgroupThreads / 32 : kNarrow ? 1 : 0);

  const int block_rows = p.warps * Cfg::kWarpRows;
  const int tile = blockIdx.x / p.splits;
  const int split = blockIdx.x % p.splits;
  const int m_block = blockIdx.y;
  const int n0 = tile * block_rows;
  const int m0 = m_block * Cfg::kBlockM;
  const int rows_m = min(Cfg::kBlockM, p.m - m0);
  const int atom_begin = SplitAtomBegin(split, p.splits, p.atoms, kForm);
  const int atom_end = SplitAtomBegin(split + 1, p.splits, p.atoms, kForm);
  const int num_atoms = atom_end - atom_begin;
  // m16 tiles of this warp inside N (kWhole7's 7-tile warps may hold an odd number). Tiles past N arrive as the
  // TMA's zeros and are never stored.
  const int warp_tiles =
      row_warp < p.warps ? max(0, min(kTiles, (p.n - n0 - row_warp * Cfg::kWarpRows) / kAtomRows)) : 0;
  const bool warp_active = warp_tiles > 0;
  const bool group32 = p.group_shift == 5;                // two groups per atom
  const int group_mask = (1 << p.group_shift) - 1;
  // Columns per promotion - 1: a group, and with raw codes at most 128 (per-channel scales).
  const int promotion_mask = kRawCodes ? min(group_mask, kRawCodesMaxPromotionCols - 1) : group_mask;

  // The X stages are wgmma operands with the 128-byte swizzle: 1 KB-aligned (the plan's slack).
  const uint32_t smem_base = tma::SwizzledSharedBase(smem_raw);
  uint8_t* smem = smem_raw + (smem_base - ptx::SharedAddress(smem_raw));
  const uint32_t weight_ring = smem_base + Cfg::kWeightRingOffset;
  const uint32_t x_ring = smem_base + Cfg::kXRingOffset;
  const uint8_t* scale_ring = smem + Cfg::kScaleRingOffset;
  const uint32_t full_barriers = smem_base + Cfg::kBarrierOffset;  // stage s: + 8 s
  const uint32_t empty_barriers = full_barriers + kStages * budget::kMbarrierBytes;
  auto full_barrier = [&](int slot) { return full_barriers + slot * static_cast<uint32_t>(budget::kMbarrierBytes); };
  auto empty_barrier = [&](int slot) { return empty_barriers + slot * static_cast<uint32_t>(budget::kMbarrierBytes); };

  // ---- main ring: one producer thread, lane 0 of the last warp (with a producer warpgroup, of its first warp;
  // narrow: the producer warp). Per stage three or four TMA boxes: the weights of every row-owning warp's
  // tiles for the stage's atoms (row blocks n0 / 16 .., contiguous, in the order warp x tiles + t,
  // L2::evict_first: read exactly once), the X tile (rows past M arrive as zeros, so their MMA columns stay
  // finite; narrow: the stage's atoms in one 3-D box of M token rows each), and the scales (and zero points)
  // of the stage's groups for the CTA's rows (a 128-wide group's are loaded by both of its atoms in the wide
  // ring: L2 hits).
  // Lane 0 of the last warp: the inline producer, and in every form the thread that prefetches the tensor maps
  // (with a producer warpgroup its last warp, which then exits: the maps are the CTA's, whichever thread warms them).
  const bool producer = tid == (launched_warps - 1) * 32;
  const uint64_t evict_first = ptx::L2EvictFirstPolicy();
  auto issue_stage = [&](int stage_offset, int slot) {  // the stage of atoms atom_begin + stage_offset ..
    const int atom = atom_begin + stage_offset;
    const uint32_t full = full_barrier(slot);
    const uint32_t scale_stage = smem_base + Cfg::kScaleRingOffset + slot * Cfg::kStageScaleBytes;
    const int group = GroupOfAtom(atom, p.group_shift);
    tma::MbarArriveExpectTx(full, p.stage_tx_bytes);
    tma::TmaLoad2dHint(tm_w, weight_ring + slot * Cfg::kStageWeightBytes, full, atom * (kAtomBytes / 8),
                       n0 / kAtomRows, evict_first);
    if constexpr (kNarrow) {
      tma::TmaLoad3dHint(tm_x, x_ring + slot * Cfg::kStageXBytes, full, 0, m0, atom, ptx::L2EvictNormalPolicy());
    } else {
      tma::TmaLoad2d(tm_x, x_ring + slot * Cfg::kStageXBytes, full, atom * kAtomCols, m0);
    }
    tma::TmaLoad2d(tm_scales, scale_stage, full, n0 / 4, group);
    if (kZeroPoints) tma::TmaLoad2d(tm_zeros, scale_stage + Cfg::kStageZerosOffset, full, n0 / 4, group);
  };

  // Narrow K-split cluster (p.splits CTAs, rank = split): rank 0's cluster-sum barrier expects the other
  // ranks' accumulators (st.async bytes). Its initialization reaches them through the cluster barrier: every
  // thread arrives after __syncthreads and waits before the main loop (the producer lane after its loop).
  const bool cluster_split = kNarrow && p.splits > 1;
  const uint32_t cluster_sums = smem_base + Cfg::kClusterSumOffset;
  const uint32_t cluster_barrier = smem_base + Cfg::kClusterBarrierOffset;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      tma::MbarInit(full_barrier(s), 1);                // the producer's arrive.expect_tx, then the bytes
      // an arrival per warp that reads it (narrow: per run)
      tma::MbarInit(empty_barrier(s), kNarrow ? Cfg::kStageAtoms / kLaneAtoms : compute_warps);
    }
    if (cluster_split && split == 0) tma::MbarInit(cluster_barrier, 1);
    tma::FenceMbarInit();
    if (cluster_split && split == 0) tma::MbarArriveExpectTx(cluster_barrier, (p.splits - 1) * Cfg::kWarpSumBytes);
  }
  if (producer) {
    tma::TmaPrefetch(tm_w);
    tma::TmaPrefetch(tm_x);
    tma::TmaPrefetch(tm_scales);
    if (kZeroPoints) tma::TmaPrefetch(tm_zeros);
  }
  __syncthreads();  // the barriers are initialized
  if (cluster_split) ptx::ClusterArriveRelease();
  if (!kProducerWarp && producer) {
    for (int i = 0; i < kStages - 1 && i < num_atoms; ++i) issue_stage(i * Cfg::kStageAtoms, i);
  }

  // ---- compute state. A wgmma accumulator of N = 8 kMTiles tokens holds, per warp, the m16 tile's
  // fragment d[4 mt + e]: row g + 8 (e / 2), token 8 mt + 2 (lane % 4) + e % 2 (the mma.sync C layout
  // per n8 tile), so the promotion, split-K and epilogue index it by (mt, e).
  constexpr int kN = 8 * kMTiles;
  constexpr int kFrag = 4 * kMTiles;  // accumulator registers per m16 tile
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  float acc[kTiles][kFrag];
  float part[kTiles][kFrag];  // Σ x·(q − z) (raw codes: Σ x·(128 + q)) since the last promotion
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int e = 0; e < kFrag; ++e) acc[t][e] = part[t][e] = 0.f;
  }
  uint32_t sub[kTiles][2] = {};  // −(magic + z) of the current group, rows g and g + 8 of each tile
  float sums[kMTiles][4] = {};   // raw codes: column-sum MMA accumulators since the last promotion
  const int row_in_block = row_warp * Cfg::kWarpRows + lane / 4;  // row g of tile 0; tile t adds 16 t, g + 8 adds 8
  uint32_t fresh_partial = 1;  // wgmma: the next wgmmas start the partials (scale-d = 0) instead of adding
  // mma.sync: ldmatrix.x4 of a token tile over 32 k (k16 steps 2h, 2h + 1): lanes 8q..8q+7 give its
  // token rows 0..7 at 16-byte chunk 4h + q of the swizzled row (token tile mt: 8 rows, 1 KB, further).
  const uint32_t x_lane_offset[2] = {SwizzledX(0, lane % 8, lane / 8), SwizzledX(0, lane % 8, 4 + lane / 8)};

  // Wide and whole-SM with an inline producer lane: atom i is computed while the TMA boxes of the next kStages - 1
  // are in flight; before computing atom i the producer refills the slot of atom i - 1 once every warp has released
  // it (its empty barrier). A producer warp (narrow, or the producer warpgroup's first) fills stage s into slot
  // s % kStages once the computing warps (narrow: the k-lanes) of stage s - kStages have released it. Narrow: the
  // atoms come in runs of kLaneAtoms, and k-lane l computes runs l, l + k_lanes, ...
  const int num_stages = (num_atoms + Cfg::kStageAtoms - 1) / Cfg::kStageAtoms;
  // Launched in k_phases phases (NarrowKPhases), the CTA starts K at its phase's stage and wraps: the loop's stage s
  // holds atoms atom_begin + (4 s + (tile mod k_phases) x phase_atoms) mod num_atoms. The k-lanes need not know: a
  // rotation by whole stages moves no group or promotion boundary within a stage, and weights, X and scales come in
  // the same stage. (The rotation computed by every thread, with a division by k_phases, cost unphased narrow launches
  // 1-5% at one token whether or not the k-lanes rotated their atom indices too, session 39: the launcher computes
  // phase_atoms, and only the producer lane the offsets.) Wide and whole-SM launches have one phase.
  if (kProducerWarp && warp >= compute_warps) {
    if constexpr (Cfg::kShiftRegisters) ptx::SetMaxRegistersDec<Cfg::kProducerRegisters>();
    if (warp == compute_warps && lane == 0) {
      int stage_offset = (tile & (p.k_phases - 1)) * p.phase_atoms;
      for (int stage = 0; stage < num_stages; ++stage) {
        if (stage >= kStages) tma::MbarWait(empty_barrier(stage % kStages), (stage / kStages - 1) & 1);
        issue_stage(stage_offset, stage % kStages);
        stage_offset = stage_offset + Cfg::kStageAtoms == num_atoms ? 0 : stage_offset + Cfg::kStageAtoms;
      }
    }
    if constexpr (!kNarrow) return;  // wide / whole: the producer warpgroup has nothing else to do
  }
  if constexpr (Cfg::kShiftRegisters) ptx::SetMaxRegistersInc<Cfg::kComputeRegisters>();
  if (cluster_split) ptx::ClusterWaitAcquire();  // rank 0's cluster-sum barrier is initialized
  const int first_atom = kProducerWarp && warp >= compute_warps ? num_atoms : k_lane * kLaneAtoms;
  auto next_atom = [&](int i) {
    return !kNarrow || (static_cast<unsigned>(i) + 1) % kLaneAtoms != 0 ? i + 1 : i + 1 + (k_lanes - 1) * kLaneAtoms;
  };
  int slot = 0;             // wide: slot of atom i
  uint32_t full_phase = 0;  // wide: parity of the slot's full barrier for atom i (flips when the slot wraps)
  for (int i = first_atom; i < num_atoms; i = next_atom(i)) {
    const int atom = atom_begin + i;  // in the loop's order (a rotated K: see the producer warp)
    // Narrow: the atom's stage, slot and place in its stage and run, in unsigned arithmetic: signed divisions
    // and remainders cost ~30 instructions an atom on the k-lanes' dependency chains (1 x 8192² 13.5 -> 13.0 us,
    // session 34).
    const unsigned narrow_index = i;
    const int stage_atom = kNarrow ? narrow_index % Cfg::kStageAtoms : 0;  // the atom's place in its stage
    const bool run_starts = narrow_index % kLaneAtoms == 0, run_ends = narrow_index % kLaneAtoms == kLaneAtoms - 1;
    int atom_slot;
    if constexpr (kNarrow) {
      const unsigned stage = narrow_index / Cfg::kStageAtoms;
      atom_slot = stage % kStages;
      if (run_starts) tma::MbarWait(full_barrier(atom_slot), (stage / kStages) & 1);  // it landed
    } else {
      if (!kProducerWarp && producer && i + kStages - 1 < num_atoms) {
        const int refill = i + kStages - 1;  // its slot last held atom refill - kStages = i - 1
        if (i > 0) tma::MbarWait(empty_barrier(refill % kStages), (refill / kStages - 1) & 1);
        issue_stage(refill * Cfg::kStageAtoms, refill % kStages);
      }
      tma::MbarWait(full_barrier(slot), full_phase);  // atom i's stage (weights, X, scales) landed
      atom_slot = slot;
      slot = slot + 1 == kStages ? 0 : slot + 1;
      full_phase ^= slot == 0;
    }

    const bool atom_starts_group = i == first_atom || (kRunsSplitGroups && run_starts) ||
                                   ((atom * kAtomCols) & group_mask) == 0;
    const bool atom_ends_partial = (((atom + 1) * kAtomCols) & promotion_mask) == 0 || (kRunsSplitGroups && run_ends) ||
                                   (kNarrow ? next_atom(i) >= num_atoms : atom + 1 == atom_end);
    // This lane's rows g of the atom's first group: scales, zero points (row g + 8 is 8 entries on, tile t 16 t)
    // (the stage's groups are in the order of its atoms)
    const int atom_group_rows =
        (GroupOfAtom(atom, p.group_shift) - GroupOfAtom(atom - stage_atom, p.group_shift)) * block_rows;
    const uint8_t* scale_stage = scale_ring + atom_slot * Cfg::kStageScaleBytes;
    const uint16_t* row_scales = reinterpret_cast<const uint16_t*>(scale_stage) + atom_group_rows + row_in_block;
    const uint8_t* row_zeros = scale_stage + Cfg::kStageZerosOffset + atom_group_rows + row_in_block;
    const uint32_t weight_addr = weight_ring + atom_slot * Cfg::kStageWeightBytes + stage_atom * kAtomBytes +
                                 (row_warp * kTiles * (Cfg::kRowBlockBytes / 16) + lane) * 16;
    uint4 words[kTiles];
#pragma unroll
    for (int t = 0; t < kTiles; ++t) words[t] = LoadShared128(weight_addr + t * Cfg::kRowBlockBytes);
    // B = the atom's X tile, K-major with the 128-byte swizzle; k16 step j starts 32 bytes into each row.
    const uint32_t x_stage = x_ring + atom_slot * Cfg::kStageXBytes + stage_atom * Cfg::kAtomXBytes;
    const uint64_t x_desc = MakeSmemDesc(x_stage, 16, 8 * kXRowBytes, kSwizzle128B);
    // Narrow: the stage's X box holds each atom's rows_m token rows one after another, so token t of the atom
    // is row stage_atom * rows_m + t of the swizzled stage; lanes of a token past M read the last token's row
    // (their MMA columns are never stored). Padding rows would arrive as TMA's zeros, which are slow to make:
    // with a box of 8 rows per atom, 1 x 8192 x 28672 took 47.6 us, with M rows 36.1 (session 16).
    auto narrow_x_rows = [&](int mt, int h) {
      const int row = stage_atom * rows_m + min(mt * 8 + lane % 8, rows_m - 1);
      return SwizzledX(x_ring + atom_slot * Cfg::kStageXBytes, row, 4 * h + lane / 8);
    };
    // mma.sync: the B fragments of k16 steps 2h and 2h + 1, per token tile. Narrow: both halves at the atom's start,
    // so their loads' latency is off the k-lanes' step chain (1 x 8192² 13.7 -> 13.5 us, session 34); the wide forms
    // load each half before its steps (the 8 more live registers cost their 16-token tiles 1-2%).
    uint32_t xk32[kMTiles][4];         // the half of the current step
    uint32_t narrow_xk[kMTiles][2][4];  // narrow: both halves
    if constexpr (kNarrow) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) ptx::LdMatrixX4(narrow_xk[mt][h], narrow_x_rows(mt, h));
      }
    }

#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // Group j / 2 of the atom (32-wide groups) or its only group: its rows in the scale stage.
      const int group_rows = group32 && j >= 2 ? block_rows : 0;
      auto zero_of = [&](int row) -> uint32_t { return kZeroPoints ? row_zeros[group_rows + row] : 8u; };
      if (!kRawCodes && ((j == 0 && atom_starts_group) || (group32 && j == 2))) {  // a group starts
#pragma unroll
        for (int t = 0; t < kTiles; ++t) {
          sub[t][0] = NegatedSubtrahend<T>(zero_of(t * kAtomRows), false);
          sub[t][1] = NegatedSubtrahend<T>(zero_of(t * kAtomRows + 8), true);
        }
      }
      uint32_t a[kTiles][4];
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        if constexpr (kRawCodes) {
          RawCodesBf16(Word(words[t], j), a[t]);
        } else {
          Dequantize<T>(Word(words[t], j), sub[t][0], sub[t][1], a[t]);
        }
      }
      if constexpr (kWgmma) {
        const uint64_t step_desc = x_desc + ((j * 32) >> 4);
        WgmmaFence();
#pragma unroll
        for (int t = 0; t < kTiles; ++t) Wgmma<kN>::template Half<kBf16>(part[t], a[t], step_desc, !fresh_partial);
        WgmmaCommit();
        fresh_partial = 0;
      } else {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          if (j % 2 == 0) {
            if constexpr (kNarrow) {
#pragma unroll
              for (int r = 0; r < 4; ++r) xk32[mt][r] = narrow_xk[mt][j / 2][r];
            } else {
              ptx::LdMatrixX4(xk32[mt], x_stage + mt * 8 * kXRowBytes + x_lane_offset[j / 2]);
            }
            if constexpr (kRawCodes) ptx::Mma16816<T>(sums[mt], xk32[mt], kOnesBf16, kOnesBf16);  // ColumnSums
          }
#pragma unroll
          for (int t = 0; t < kTiles; ++t) {
            ptx::Mma16816<T>(TokenTile(part[t], mt), a[t], xk32[mt][(j % 2) * 2], xk32[mt][(j % 2) * 2 + 1]);
          }
        }
      }
      const bool partial_ends = j == 3 ? atom_ends_partial : (group32 && j == 1);
      if (partial_ends) {  // promotion: acc += s · Σ x·(q − z), in fp32
        if constexpr (kWgmma) {
          WgmmaWait<0>();
#pragma unroll
          for (int t = 0; t < kTiles; ++t) FenceOperands(part[t]);
        }
        float token_sums[kMTiles][2];  // raw codes: Σ x of this lane's tokens 8 mt + 2c, 8 mt + 2c + 1
        if constexpr (kRawCodes) {
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) TokenSums(sums[mt], lane, token_sums[mt]);
        }
#pragma unroll
        for (int t = 0; t < kTiles; ++t) {
          const float scales[2] = {ScaleToFloat<T>(row_scales[group_rows + t * kAtomRows]),       // row g
                                   ScaleToFloat<T>(row_scales[group_rows + t * kAtomRows + 8])};  // row g + 8
          float offsets[2] = {};
          if constexpr (kRawCodes) {
            offsets[0] = RawCodeOffset(zero_of(t * kAtomRows));
            offsets[1] = RawCodeOffset(zero_of(t * kAtomRows + 8));
          }
#pragma unroll
          for (int e = 0; e < kFrag; ++e) {
            const int row = (e / 2) % 2;                   // row g or g + 8
            float exact_part = part[t][e];                 // Σ x·(q − z)
            if constexpr (kRawCodes) {                     // Σ x·(128 + q) − (128 + z)·Σ x, rounded once
              exact_part = fmaf(offsets[row], token_sums[e / 4][e % 2], exact_part);
            }
            acc[t][e] = fmaf(scales[row], exact_part, acc[t][e]);
            if constexpr (!kWgmma) part[t][e] = 0.f;
          }
        }
        if constexpr (kRawCodes) {
#pragma unroll
          for (int e = 0; e < 4 * kMTiles; ++e) sums[e / 4][e % 4] = 0.f;
        }
        fresh_partial = 1;
      } else if (kWgmma && j == 3) {
        WgmmaWait<0>();  // the atom's wgmmas have read its slot
      } else if (kWgmma) {
        WgmmaWait<1>();  // step j - 1 retired: its A registers are free
      }
    }
    __syncwarp();  // every lane's reads of the slot are done
    const bool run_read = !kNarrow || run_ends || i + 1 == num_atoms;
    if (lane == 0 && run_read) tma::MbarArrive(empty_barrier(atom_slot));
  }

  // ---- narrow: the k-lanes' accumulators, added in lane order through shared memory (the ring's bytes:
  // every stage has been issued, and waited for by its k-lane); in a K-split cluster, then the ranks' sums,
  // added by rank 0 in rank order
  if constexpr (kNarrow) {
    constexpr int kVecs = kTiles * kFrag / 4;
    float4* lane_sums = reinterpret_cast<float4*>(smem);
    __syncthreads();
    if (k_lane > 0 && k_lane < k_lanes) {
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const float* a = &acc[v / (kFrag / 4)][4 * (v % (kFrag / 4))];
        lane_sums[((k_lane - 1) * kVecs + v) * 32 + lane] = make_float4(a[0], a[1], a[2], a[3]);
      }
    }
    __syncthreads();
    if (k_lane > 0) return;  // and the producer warp
    for (int l = 1; l < k_lanes; ++l) {
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const float4 s = lane_sums[((l - 1) * kVecs + v) * 32 + lane];
        float* a = &acc[v / (kFrag / 4)][4 * (v % (kFrag / 4))];
        a[0] += s.x;
        a[1] += s.y;
        a[2] += s.z;
        a[3] += s.w;
      }
    }
    if (cluster_split) {
      static_assert(Cfg::kWarpSumBytes == kVecs * 32 * 16, "a slot: float4 v of lane l at 512 v + 16 l");
      const uint32_t lane_sum = lane * 16;
      if (split > 0) {  // into rank 0's slot split - 1, then done (rank 0 waits for the bytes, not for us)
        const uint32_t slot = ptx::MapSharedToCta(cluster_sums + (split - 1) * Cfg::kWarpSumBytes + lane_sum, 0);
        const uint32_t remote_barrier = ptx::MapSharedToCta(cluster_barrier, 0);
#pragma unroll
        for (int v = 0; v < kVecs; ++v) {
          const float* a = &acc[v / (kFrag / 4)][4 * (v % (kFrag / 4))];
          ptx::StoreAsyncRemote(slot + v * 512, make_float4(a[0], a[1], a[2], a[3]), remote_barrier);
        }
        return;
      }
      tma::MbarWait(cluster_barrier, 0);
      for (int r = 1; r < p.splits; ++r) {
#pragma unroll
        for (int v = 0; v < kVecs; ++v) {
          const uint4 s = LoadShared128(cluster_sums + (r - 1) * Cfg::kWarpSumBytes + v * 512 + lane_sum);
          float* a = &acc[v / (kFrag / 4)][4 * (v % (kFrag / 4))];
          a[0] += __uint_as_float(s.x);
          a[1] += __uint_as_float(s.y);
          a[2] += __uint_as_float(s.z);
          a[3] += __uint_as_float(s.w);
        }
      }
    }
  }

  // ---- split-K: fragment-order partials; for each row warp, the last of its splits to arrive sums them in split
  // order
  if (!kNarrow && p.splits > 1) {
    // Lane quad c holds tokens 2c, 2c + 1 of each token tile. With one token tile, only the quads that
    // hold a token < M are stored and summed (M = 1: a quarter of the bytes; the others hold padding
    // tokens, which the epilogue never stores), packed in fragment order.
    const int live_quads = kMTiles == 1 ? min(4, (rows_m + 1) / 2) : 4;
    const int live_lanes = 8 * live_quads;
    const bool lane_live = lane % 4 < live_quads;
    const size_t slot_float4s = static_cast<size_t>(p.warps) * kTiles * kMTiles * live_lanes;
    float4* tile_partials =
        p.partials + static_cast<size_t>(m_block * p.n_tiles + tile) * p.splits * slot_float4s;
    const int fragment = row_warp * kTiles * kMTiles * live_lanes + (lane / 4) * live_quads + lane % 4;
    if (!warp_active) return;  // its rows are past N in every split
    if (lane_live) {
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          tile_partials[split * slot_float4s + fragment + (t * kMTiles + mt) * live_lanes] =
              make_float4(acc[t][4 * mt], acc[t][4 * mt + 1], acc[t][4 * mt + 2], acc[t][4 * mt + 3]);
        }
      }
    }
    // One counter per tile and row warp (W4a16ArrivalCounters): the last of a row warp's splits to arrive sums that
    // warp's rows, with no wait for the CTA's other warps.
    const int counter = (m_block * p.n_tiles + tile) * W4a16CounterWarps(kMTiles, kForm) + row_warp;
    if (!WarpArriveLast(g_arrival_counters + counter, p.splits)) return;
    // Split-major, every fragment's load of a split issued together and ~16 float4 loads in flight: the
    // sum costs ~splits x fragments / 16 L2 round trips instead of one per split and fragment.
    constexpr int kSplitsInFlight = std::max(1, 16 / (kTiles * kMTiles));
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
#pragma unroll
      for (int e = 0; e < kFrag; ++e) acc[t][e] = 0.f;
    }
    if (lane_live) {
#pragma unroll kSplitsInFlight
      for (int s = 0; s < p.splits; ++s) {
        float4 v[kTiles][kMTiles];
#pragma unroll
        for (int t = 0; t < kTiles; ++t) {
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            v[t][mt] = __ldcg(tile_partials + s * slot_float4s + fragment + (t * kMTiles + mt) * live_lanes);
          }
        }
#pragma unroll
        for (int t = 0; t < kTiles; ++t) {
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            acc[t][4 * mt] += v[t][mt].x;
            acc[t][4 * mt + 1] += v[t][mt].y;
            acc[t][4 * mt + 2] += v[t][mt].z;
            acc[t][4 * mt + 3] += v[t][mt].w;
          }
        }
      }
    }
  }

  // ---- epilogue: + β in fp32, one rounding to the output dtype
  if (!warp_active) return;
  const bool poison = p.act_order_flag != nullptr && __ldg(p.act_order_flag) != 0;
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    if (t >= warp_tiles) break;
    const int n_lo = n0 + row_in_block + t * kAtomRows;
    const int n_hi = n_lo + 8;
    const float bias_lo = bias != nullptr ? ToFloat(bias[n_lo]) : 0.f;
    const float bias_hi = bias != nullptr ? ToFloat(bias[n_hi]) : 0.f;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = m0 + mt * 8 + (lane % 4) * 2 + e;
        if (m >= p.m) continue;
        const float lo = poison ? __int_as_float(0x7FC00000) : acc[t][4 * mt + e] + bias_lo;
        const float hi = poison ? __int_as_float(0x7FC00000) : acc[t][4 * mt + 2 + e] + bias_hi;
        y[static_cast<size_t>(m) * p.n + n_lo] = FromFloat<T>(lo);
        y[static_cast<size_t>(m) * p.n + n_hi] = FromFloat<T>(hi);
      }
    }
  }
}

// Act-order: x_perm[:, i] = x[:, perm[i]], and NaN columns where g_idx does not match the stored
// permutation (canonical act-order: stored column i belongs to group i / group_size).
template <typename T>
__global__ void GatherActOrderColumns(const T* x, const int32_t* perm, const int32_t* g_idx, T* x_perm,
                                      int m, int k, int group_size) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= k) return;
  const int column = perm[i];
  const bool valid = column >= 0 && column < k && g_idx[column] == i / group_size;
  const T nan = FromFloat<T>(__int_as_float(0x7FC00000));
  for (int row = blockIdx.y; row < m; row += gridDim.y) {
    x_perm[static_cast<size_t>(row) * k + i] = valid ? x[static_cast<size_t>(row) * k + column] : nan;
  }
}

// ------------------------------------------------------------------------------------------- host

int Log2(int64_t power_of_two) {
  int log = 0;
  while ((int64_t{1} << log) < power_of_two) ++log;
  return log;
}

// x: the activations or their act-order gather (m, k); the weights, scales and zeros in their kernel layouts.
template <typename T, int kMTiles, W4a16Form kForm>
cudaError_t LaunchTyped(KernelParams params, const W4a16Launch& plan, const void* x, const GemmArgs& args,
                        cudaStream_t stream) {
  using Cfg = Config<kMTiles, kForm>;
  constexpr bool kNarrow = Cfg::kNarrow;
  constexpr int kShortRun = kNarrow ? kNarrowShortRunAtoms : 1;  // wide: lane_atoms 1, a stage of 1 atom
  constexpr int kStageRun = HasStageRuns(kMTiles, kForm) ? Cfg::kStageAtoms : kShortRun;  // wide: both 1
  if (plan.lane_atoms != kShortRun && plan.lane_atoms != kStageRun) return cudaErrorInvalidConfiguration;
  auto* kernel = args.zeros != nullptr
                     ? (plan.lane_atoms == kShortRun ? &W4a16GemmKernel<T, kMTiles, true, kForm, kShortRun>
                                                     : &W4a16GemmKernel<T, kMTiles, true, kForm, kStageRun>)
                     : (plan.lane_atoms == kShortRun ? &W4a16GemmKernel<T, kMTiles, false, kForm, kShortRun>
                                                     : &W4a16GemmKernel<T, kMTiles, false, kForm, kStageRun>);
  constexpr int kSmem = Cfg::kSmemBytes;
  const uint64_t m = params.m, n = params.n, k = params.k, row_blocks = n / kAtomRows;
  const uint64_t groups = k / args.group_size;
  const uint64_t row_block_words = uint64_t(params.atoms) * kAtomBytes / 8;  // row block nb at nb x atoms x 512 B
  const uint32_t block_rows = plan.warps * Cfg::kWarpRows;
  const uint32_t stage_cols = Cfg::kStageAtoms * kAtomCols;
  const uint32_t groups_per_stage = std::max<uint32_t>(1, stage_cols / static_cast<uint32_t>(args.group_size));
  // A stage's boxes (in their maps' elements: u64, u16, u32, u32). Their bytes are what a stage's full barrier
  // expects, and each must fit its slot of the stage (a short count would hang the ring, a long box overwrite
  // the next slot). Narrow, X is (k % 64, m, k / 64): one box holds the stage's atoms one after another.
  const uint32_t weight_box[2] = {Cfg::kStageAtoms * kAtomBytes / 8, block_rows / kAtomRows};
  const uint32_t x_rows = static_cast<uint32_t>(kNarrow ? std::min<uint64_t>(m, Cfg::kBlockM) : Cfg::kBlockM);
  const uint32_t x_box[3] = {kAtomCols, x_rows, Cfg::kStageAtoms};
  const uint32_t scale_box[2] = {block_rows / 4, groups_per_stage};
  const uint32_t zero_box[2] = {block_rows / 4, groups_per_stage};
  const uint32_t weight_bytes = tma::BoxBytes(weight_box, 8), x_bytes = tma::BoxBytes(x_box, 2);
  const uint32_t scale_bytes = tma::BoxBytes(scale_box, 8);
  const uint32_t zero_bytes = args.zeros != nullptr ? tma::BoxBytes(zero_box, 4) : 0;
  if (weight_bytes > Cfg::kStageWeightBytes || x_bytes > Cfg::kStageXBytes || scale_bytes > Cfg::kStageZerosOffset ||
      zero_bytes > Cfg::kStageScaleBytes - Cfg::kStageZerosOffset) {
    return cudaErrorInvalidValue;
  }
  params.stage_tx_bytes = weight_bytes + x_bytes + scale_bytes + zero_bytes;
  CUtensorMap tm_w{}, tm_x{}, tm_scales{}, tm_zeros{};
  const auto none = CU_TENSOR_MAP_SWIZZLE_NONE;
  bool encoded =
      tma::EncodeTiled<2>(&tm_w, CU_TENSOR_MAP_DATA_TYPE_UINT64, args.qweight, {row_block_words, row_blocks},
                          {row_block_words * 8}, weight_box, none) &&
      (kNarrow ? tma::EncodeTiled<3>(&tm_x, CU_TENSOR_MAP_DATA_TYPE_UINT16, x, {kAtomCols, m, k / kAtomCols},
                                     {k * sizeof(T), kAtomCols * sizeof(T)}, x_box, CU_TENSOR_MAP_SWIZZLE_128B)
               : tma::EncodeTiled<2>(&tm_x, CU_TENSOR_MAP_DATA_TYPE_UINT16, x, {k, m}, {k * sizeof(T)},
                                     {x_box[0], x_box[1]}, CU_TENSOR_MAP_SWIZZLE_128B)) &&
      tma::EncodeTiled<2>(&tm_scales, CU_TENSOR_MAP_DATA_TYPE_UINT64, args.scales, {n / 4, groups}, {n * kScaleBytes},
                          scale_box, none);
  if (args.zeros != nullptr) {
    encoded = encoded && tma::EncodeTiled<2>(&tm_zeros, CU_TENSOR_MAP_DATA_TYPE_UINT32, args.zeros, {n / 4, groups},
                                             {n * kZeroBytes}, zero_box, none);
  }
  if (!encoded) return cudaErrorInvalidValue;
  // Per call, not once per process: the attribute belongs to the current device's context.
  if (cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
      status != cudaSuccess) {
    return status;
  }
  // Narrow K-split: the splits of a row tile (consecutive blocks) form one cluster, rank = split.
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kNarrow ? plan.splits : 1;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(plan.n_tiles * plan.splits, plan.m_blocks);
  config.blockDim = dim3(W4a16LaunchThreads(plan));
  config.dynamicSmemBytes = kSmem;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = kNarrow && plan.splits > 1 ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, tm_w, tm_x, tm_scales, tm_zeros, params);
}

// The instance of plan.form for one token tile (HasForm: the forms PlanW4a16Launch gives it), wide otherwise.
template <typename T, int kMTiles>
cudaError_t LaunchForm(const KernelParams& params, const W4a16Launch& plan, const void* x, const GemmArgs& args,
                       cudaStream_t stream) {
  using F = W4a16Form;
  if constexpr (kMTiles <= kMaxMmaSyncMTiles) {
    if (plan.form == F::kNarrow) return LaunchTyped<T, kMTiles, F::kNarrow>(params, plan, x, args, stream);
    if (plan.form == F::kNarrow32) return LaunchTyped<T, kMTiles, F::kNarrow32>(params, plan, x, args, stream);
  }
  if constexpr (HasForm(kMTiles, F::kWhole)) {
    if (plan.form == F::kWhole) return LaunchTyped<T, kMTiles, F::kWhole>(params, plan, x, args, stream);
  }
  if constexpr (HasForm(kMTiles, F::kWhole7)) {
    if (plan.form == F::kWhole7) return LaunchTyped<T, kMTiles, F::kWhole7>(params, plan, x, args, stream);
  }
  return LaunchTyped<T, kMTiles, F::kWide>(params, plan, x, args, stream);
}

template <typename T>
cudaError_t LaunchForDtype(const GemmArgs& args, const W4a16Launch& plan, const W4a16Workspace& ws, void* workspace,
                           cudaStream_t stream) {
  uint8_t* base = static_cast<uint8_t*>(workspace);
  const int32_t* tail = args.qweight + (args.n / kAtomRows) * 2 * args.k;  // perm, then the flag

  KernelParams params{};
  const void* x = args.x;
  if (args.g_idx != nullptr) {
    T* x_perm = reinterpret_cast<T*>(base + ws.x_perm);
    const dim3 grid(static_cast<unsigned>((args.k + 255) / 256), static_cast<unsigned>(std::min<int64_t>(args.m, kMaxGridY)));
    GatherActOrderColumns<T><<<grid, 256, 0, stream>>>(static_cast<const T*>(args.x), tail, args.g_idx, x_perm,
                                                       static_cast<int>(args.m), static_cast<int>(args.k),
                                                       static_cast<int>(args.group_size));
    if (cudaError_t status = cudaGetLastError(); status != cudaSuccess) return status;
    x = x_perm;
  } else {
    params.act_order_flag = tail + args.k;  // weights stored permuted but no g_idx given: NaN out
  }
  if (plan.splits > 1) {
    params.partials = reinterpret_cast<float4*>(base + ws.partials);
  }
  params.bias = args.bias;
  params.y = args.y;
  params.m = static_cast<int>(args.m);
  params.n = static_cast<int>(args.n);
  params.k = static_cast<int>(args.k);
  params.group_shift = args.group_size == args.k ? kPerChannelShift : Log2(args.group_size);
  params.atoms = static_cast<int>(args.k / kAtomCols);
  params.warps = plan.warps;
  params.n_tiles = plan.n_tiles;
  params.splits = plan.splits;
  if (plan.k_phases < 1 || (plan.k_phases & (plan.k_phases - 1)) != 0 ||
      (plan.k_phases > 1 && (!IsNarrow(plan.form) || params.atoms % kNarrowStageAtoms != 0 || plan.splits != 1))) {
    return cudaErrorInvalidConfiguration;
  }
  params.k_phases = plan.k_phases;
  params.phase_atoms = params.atoms / kNarrowStageAtoms / plan.k_phases * kNarrowStageAtoms;
  switch (plan.m_tiles) {
    case 1: return LaunchForm<T, 1>(params, plan, x, args, stream);
    case 2: return LaunchForm<T, 2>(params, plan, x, args, stream);
    case 4: return LaunchForm<T, 4>(params, plan, x, args, stream);
    default: return LaunchForm<T, 8>(params, plan, x, args, stream);
  }
}

}  // namespace

cudaError_t LaunchGemm(const GemmArgs& args, void* workspace, size_t workspace_bytes, int num_sms,
                       cudaStream_t stream) {
  const W4a16Problem problem = ProblemOf(args);
  if (!W4a16ShapeSupported(problem) || num_sms < 1 || num_sms > kMaxNumSms) {
    return cudaErrorInvalidValue;
  }
  const W4a16Launch plan = PlanW4a16Launch(problem, num_sms);
  const W4a16Workspace ws = LayOutW4a16Workspace(problem, plan);
  if (ws.total > 0 && (workspace == nullptr || static_cast<int64_t>(workspace_bytes) < ws.total)) {
    return cudaErrorInvalidValue;
  }
  return args.dtype == Dtype::kFp16 ? LaunchForDtype<__half>(args, plan, ws, workspace, stream)
                                    : LaunchForDtype<__nv_bfloat16>(args, plan, ws, workspace, stream);
}

int64_t W4a16ArmedCounters() { return ArmedArrivalCounters(); }

}  // namespace jax_w4a4::sm90::w4a16
