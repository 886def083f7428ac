// act_quant (sm_90a): X (M, K) bf16/fp16 -> q (one float8_e4m3fn code per value for every format: the
// int4/uint4 values are integers, exact in e4m3), per-group scales, and the low-rank down projection
// LA = X · L_down (fp32), in one pass over X.
// Byte contract: docs/layouts.md, section act_quant.
//
// Work split (PlanActQuantLaunch in act_quant_plan.h, which also sizes the workspace for the FFI
// lowering). A CTA owns kBlockRows rows (64 for large M, 16 for small M) and a contiguous range of
// 128-wide K chunks. When the row blocks alone cannot fill the CTAs the GPU holds at once, the K range is
// split over S CTAs (grid row blocks x S). With a low-rank branch each of them writes its fp32 LA partial
// to the workspace and arrives at its row block's counter; the last one sums the S partials in split
// order (deterministic) and writes LA. No thread-block cluster: 8-CTA clusters do not fit one wave on an H200.
// Every CTA lets the next kernel start at once (griddepcontrol.launch_dependents): in the W4A4 linear the GEMM
// follows with programmatic dependent launch: its CTAs start on the SMs this kernel leaves free and set up
// while it runs, and each CTA of this kernel arrives at the linear's token-ready counter once its codes and
// scales are stored, so the GEMM loads them while the LA split sum still runs (w4a4_gemm.cu, WaitForTokens).
// There, at decode (16-row blocks), it also writes the GEMM's promotion records: per token and group of 64 the
// scale and the codes' sum times it (ActQuantArgs::promotion_records), with which the GEMM's decode tiles cancel
// their weights' offset.
//
// Occupancy and bandwidth (act_quant_plan.h; python -m jax_w4a4.budget prints the plans). 4.2 TB/s is
// ~16 B/cycle/SM at 1.98 GHz; a value moves ~3.06 B (X 2, q 1, scales and LA), so ~5.2 values/cycle/SM.
// The SASS issues ~17 instructions per value (ncu, session 22, M = 4096, K = 12288, r = 32: 26.6 M warp
// instructions; the quantizer ~13.6 of them, of which the bit-exact divisions 6, unpack + absmax 2,
// rounding 2, packing 0.5), so at full bandwidth the SM would issue ~2.8 of its 4 warp-instructions per
// cycle: the kernel is bound by issue and latency, not by DRAM (an XLA convert of X to e4m3, the same
// 2 B in and 1 B out per value, reaches 60-62% of 4.2 TB/s; benchmarks/NOTES.md, session 22).
// Large M, rank <= 32: CTAs of 64 rows x 128 threads (4 warps), 4 per SM (__launch_bounds__ min blocks 4:
// 128 registers; 53 KB of shared memory each, 2 ring stages of 24.5 KB: X 16 KB + L_down 8 KB + lambdas),
// so 16 warps per SM from 4 independent CTAs: one CTA's barrier or shuffle wait is hidden by the other
// three (8-warp CTAs, 2 per SM with 4 stages, were 6% slower). Little's law: ~4.2 TB/s x ~1 us of loaded
// DRAM latency / 132 SMs = ~32 KB of reads in flight per SM; each CTA keeps its next 24 KB stage in flight
// while it computes the current one, so 4 CTAs keep ~96 KB per SM in flight. The L_down tile is shared by
// the CTA's 64 rows (re-reads from L2: 0.5 B per X byte at rank 32). M = 4096 runs 64 row blocks x S = 8:
// one wave of 512 of the 528 resident CTAs. From 1024 rows every launch takes 64-row blocks, and no K split
// goes past one wave (at 1024-3072 rows, 16-row blocks, some in 1.3 waves, took 1.35-1.8x as long; session
// 41). Small M (16-row blocks, S up to 32 with two chunks a CTA, then up to 64 down to one chunk a CTA while the
// grid keeps to one CTA per SM and the chunks saved outweigh the sum's added rounds: sessions 42-43) keeps M = 1..64
// on 32+ SMs; ranks above 32 run fewer, larger CTAs.
//
// Pipeline (one per CTA, every thread takes every role but the loads; a kStages-deep ring, one
// __syncthreads per chunk, which with 4 CTAs per SM costs one CTA's issue slots, not the SM's):
//  * load:     thread 0, on the stage's full mbarrier: one TMA box of the chunk's X tile (rows past M and
//              k past K arrive as zeros; L2 evict-first: read once), one TMA box per L_down slab (ranks
//              past the rank and k past K arrive as zeros) and a bulk copy of the NEXT chunk's 128
//              smoothing factors. Per-thread copies cost ~3 instructions per value and 12% of the stall
//              samples (X, session 21), then 80 instructions per warp and chunk (L_down, session 22).
//  * table:    128 threads turn those factors into the next chunk's column table (lambda and its
//              division reciprocal), so the quantizer never recomputes reciprocals.
//  * quantize: each thread takes units of 16 consecutive k of one row from the staged X tile, kPasses
//              passes of kUnits rows, each pass with its 16 column lambdas from the table (registers for
//              two units, not for a chunk's lambdas): X̂ = fp32(X) / lambda, group absmax by warp shuffles,
//              scale (computed once per group and shared), q; writes q and the scale.
//  * low-rank: each warp runs mma.sync m16n8k16 (bf16/fp16 -> fp32) with A = the same staged X tile
//              (ldmatrix, once per k16 step for all its column pairs) and B = the L_down tile
//              (ldmatrix.trans); accumulators stay in registers.
//  * epilogue: LA as fp32; with a K split, partials through the workspace, summed in a fixed order by the
//              row block's last CTA (an arrival counter of common/arrival_counters.h: no memset; at decode
//              groups of lanes per LA quad, so 64 splits take one round of loads). The CTA publishes its
//              partial and arrives before it quantizes its last chunk. (Summing the partials through
//              distributed shared memory in clusters of the splits lost at every size measured: session 42.)
//
// Shared memory (ActQuantPlan, static_assert'ed: the ring fits kCtasPerSm CTAs per SM), from a 1 KB-aligned
// base: the X tiles (kBlockRows x 256 B each, TMA's 128-byte swizzle: XPieceOffset), the L_down tiles (128
// k x kRankCap ranks in 64-rank slabs, TMA's 128- or 64-byte swizzle: LoraLayout), the lambdas (512 B a
// stage), the double-buffered column table (2 KB, quads interleaved: TableIndex) and a full mbarrier per
// stage.
//
// Exact division. The contract is IEEE division (x / lambda, absmax / qmax, X̂ / scale), bit for bit with
// __fdiv_rn. __fdiv_rn costs ~9 instructions per element (MUFU.RCP, FCHK, 5 FFMA, a branch), which
// would make this kernel issue-bound. We run the fast path the compiler emits for div.rn.f32
// (reciprocal refined once by Newton, quotient, one exact fma residual correction) with the reciprocal
// hoisted per column (column table) and per group, so the per-element cost is 3 instructions. The
// compiler guards that path with FCHK (operand ranges); we guard it with a stricter domain: lambda in
// [2^-20, 2^20] (else its table reciprocal is NaN), group absmax below 2^40 and not NaN, and for bf16
// a group absmax of at least 2^-20 unless the group is all zeros. A warp that sees a group outside the
// domain recomputes its units with __fdiv_rn. Zeros keep their sign (fp8 stores -0 as 0x80, like the
// reference). The domain was checked in a numpy emulation (exact fma) against IEEE division: 1.2e8
// random operand pairs with the reciprocal seed within +-2 ulp of 1/b (MUFU.RCP's error is ~1 ulp),
// plus seeds off by 300 ulp, plus the tiny-dividend sign and magnitude claims below.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "common/arrival_counters.h"
#include "common/promotion_records.h"
#include "common/ptx.h"
#include "common/smem_budget.h"
#include "common/tma.h"
#include "kernels/sm90/act_quant.h"
#include "kernels/sm90/act_quant_plan.h"

namespace jax_w4a4::sm90 {
namespace {

using ptx::LdMatrixX4;
using ptx::Mma16816;


constexpr int kChunkK = 128;            // k per pipeline stage: two int4 groups or one fp8 group
constexpr int kPieceBytes = 16;         // one swizzle chunk = 8 halves
constexpr int kXHalfK = 64;             // k of a 128-byte half row: the TMA box's inner extent
constexpr int kXRowBytes = kChunkK * 2;  // 256, unpadded (swizzled)
constexpr int kUnitK = 16;              // quantizer unit: 16 consecutive k of one row (two pieces)
constexpr int kUnitsPerRow = kChunkK / kUnitK;  // 8
constexpr int kMaxRank = 256;
constexpr int64_t kMaxK = kActQuantMaxK;  // keeps offsets inside a row block in 32 bits

// Byte offset of piece p (16 bytes, k = 8p .. 8p + 7) of row r in an X tile as TMA writes it: a 3-D box
// (64 k, 2 halves, rows) with the 128-byte swizzle, so row r is 256 bytes, its half h = p / 8 the 128-byte
// segment 2r + h, whose chunk c = p % 8 lands at c ^ ((2r + h) % 8). A quantizer lane's two pieces (2u,
// 2u + 1) are in one half, the second at the first ^ 16; the 8 lanes of a row hit 8 distinct bank groups
// (the halves' XOR phases differ in parity); ldmatrix's 8 rows of one piece are 2-way (rows r and r + 4).
__host__ __device__ constexpr uint32_t XPieceOffset(int r, int p) {
  const int h = p / 8;
  return static_cast<uint32_t>(r * kXRowBytes + h * 128 + (((p % 8) ^ ((2 * r + h) % 8)) * kPieceBytes));
}

// An L_down tile (128 k x kRankCap ranks) as TMA writes it: slabs of kSlabRanks ranks (64, or all of a
// 32-rank cap), each one 2-D box of 128 rows with the swizzle that matches its row length (128 or 64 bytes).
template <int kRankCap>
struct LoraLayout {
  static constexpr int kSlabRanks = kRankCap < 64 ? kRankCap : 64;
  static constexpr int kSlabRowBytes = 2 * kSlabRanks;
  static constexpr int kSlabBytes = kChunkK * kSlabRowBytes;
  static constexpr int kSlabs = kSlabRanks == 0 ? 0 : kRankCap / kSlabRanks;
  static constexpr int kPiecesPerSlabRow = kSlabRanks == 0 ? 1 : kSlabRanks / 8;  // (1: no branch, never used)
  // Byte offset of piece j (8 ranks) of row kk (one k): in its slab, the piece's 16-byte chunk is XORed with
  // kk % 8 (128-byte swizzle) or (kk / 2) % 4 (64-byte swizzle: two rows share a 128-byte line), so
  // ldmatrix.trans's 8 consecutive rows of one piece hit 8 distinct bank groups. Slabs are 1 KB-aligned.
  static __host__ __device__ constexpr uint32_t PieceOffset(int kk, int j) {
    const int slab = j / kPiecesPerSlabRow, c = j % kPiecesPerSlabRow;
    const int f = kSlabRowBytes == 128 ? kk % 8 : (kk / 2) % 4;
    return static_cast<uint32_t>(slab * kSlabBytes + kk * kSlabRowBytes + (c ^ f) * kPieceBytes);
  }
};

// Tile shape, warp roles and the shared-memory budget of one kernel instance, from its plan
// (act_quant_plan.h: the same constexpr plan python -m jax_w4a4.budget prints).
template <int kBlockRows_, int kRankCap_>
struct TileConfig {
  static constexpr ActQuantPlan kPlan = SolveActQuantPlan({kBlockRows_, kRankCap_});
  static constexpr int kBlockRows = kBlockRows_;
  static constexpr int kRankCap = kRankCap_;  // largest rank this instance serves (0: no low-rank branch)
  static constexpr int kWarps = kPlan.warps;
  static constexpr int kThreads = kPlan.threads;
  static constexpr int kCtasPerSm = kPlan.ctas_per_sm;
  // Quantizer: 8 consecutive threads per row, thread t takes unit t % 8 of rows t / 8 + i * kQuantRowStep,
  // kUnits of them per pass, kPasses passes per chunk.
  static constexpr int kQuantRowStep = kThreads / kUnitsPerRow;
  static constexpr int kUnits = kPlan.units_per_pass;
  static constexpr int kPasses = kPlan.passes;
  // Low-rank: warps form kRowTiles (16 rows each) x kColGroups; n16 column pairs are dealt round-robin
  // over the column groups.
  static constexpr int kRowTiles = kBlockRows / 16;
  static constexpr int kColGroups = kWarps / kRowTiles;
  static constexpr int kPairsPerWarp = (kRankCap / 16 + kColGroups - 1) / kColGroups;
  static constexpr int kAccumulatorsPerThread = kPairsPerWarp * 2 * 4;
  using Lora = LoraLayout<kRankCap>;
  // Shared memory, from the 1 KB-aligned base: the X ring, the L_down ring, the lambda ring (each stage the
  // NEXT chunk's 128 lambdas), the column table (double buffered: a chunk's lambdas and their division
  // reciprocals, NaN where lambda is outside the fast path's domain, built one chunk ahead), the full
  // mbarriers; kSmemBytes adds the slack that aligns the base.
  static constexpr int kXTileBytes = static_cast<int>(kPlan.x_tile_bytes);
  static constexpr int kLambdaBytes = static_cast<int>(kPlan.lambda_bytes);
  static constexpr int kLoraTileBytes = static_cast<int>(kPlan.lora_tile_bytes);
  static constexpr int kStages = kPlan.stages;
  static constexpr int kLoraRingOffset = kStages * kXTileBytes;
  static constexpr int kLambdaRingOffset = kLoraRingOffset + kStages * kLoraTileBytes;
  static constexpr int kTableOffset = kLambdaRingOffset + kStages * kLambdaBytes;
  static constexpr int kBarrierOffset = kTableOffset + static_cast<int>(kPlan.column_table_bytes);
  static constexpr int kSmemBytes = static_cast<int>(kPlan.total_bytes);

  static_assert(kPlan.fits(), "the ring needs two stages with kCtasPerSm CTAs resident per SM");
  static_assert(kChunkK == kActQuantChunkK && kXTileBytes == kBlockRows * kXRowBytes, "plan and kernel agree");
  static_assert(kPlan.column_table_bytes == 2 * 2 * kChunkK * 4, "column table: two chunks of (lambda, 1/lambda)");
  static_assert(kBlockRows % 16 == 0 && kWarps % kRowTiles == 0, "warps must tile the row block");
  static_assert(kQuantRowStep % 4 == 0, "a thread's rows share (2r) % 8, so its swizzled offsets differ by constants");
  static_assert(kPasses * kUnits * kQuantRowStep == kBlockRows, "units divide evenly");
  static_assert(kUnits >= 1 && kUnits <= 2, "at most two units (32 X̂ registers) per pass");
  static_assert(kRankCap % 16 == 0 && kRankCap <= kMaxRank, "rank is a multiple of 16, at most 256");
  static_assert(Lora::kSlabs * Lora::kSlabBytes == kLoraTileBytes && kPlan.lora_row_pitch == 2 * kRankCap,
                "the L_down tile is the plan's");
  static_assert(kAccumulatorsPerThread <= 64, "LA accumulators must stay in registers");
  static_assert(kXTileBytes % budget::kSwizzledAlign == 0 && kLoraRingOffset % budget::kSwizzledAlign == 0 &&
                    Lora::kSlabBytes % budget::kSwizzledAlign == 0,
                "every X tile and L_down slab starts a swizzle atom (1 KB)");
  static_assert(kLambdaRingOffset % budget::kBulkAlign == 0 && kLambdaBytes % budget::kBulkAlign == 0,
                "bulk-copy destinations");
  static_assert(kBarrierOffset % budget::kMbarrierBytes == 0 && kPlan.barrier_bytes == kStages * budget::kMbarrierBytes,
                "a full mbarrier per stage");
  static_assert(kSmemBytes == kBarrierOffset + kPlan.barrier_bytes + budget::kSwizzledAlign, "the layout is the plan");
  static_assert(kXTileBytes + kLambdaBytes + kLoraTileBytes < (1 << 20), "mbarrier tx-count range");
};

struct Params {
  const float* smooth;
  uint8_t* q;
  uint8_t* scales;
  float* la;
  float* la_partials;  // K split with rank > 0: (row block, split, kBlockRows, rank) fp32 in the workspace
  int64_t rows;
  int k;
  int rank;
  int num_chunks;
  int k_splits;
  uint32_t* tokens_ready;  // ActQuantArgs::tokens_ready
  float2* promotion_records;  // ActQuantArgs::promotion_records, or nullptr
};

// ---- PTX wrappers ---------------------------------------------------------------------------------

// Shared-memory accesses by explicit address (the stage ring is addressed as 32-bit shared offsets).
__device__ __forceinline__ uint4 LdShared128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ float4 LdShared128f(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ float LdShared32f(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ void StShared32f(uint32_t addr, float a) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(a) : "memory");
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}


// max that propagates NaN (like jnp.max), so a NaN in a group is seen by the range check.
__device__ __forceinline__ float MaxNan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// ---- exact division -------------------------------------------------------------------------------

// The reciprocal of div.rn.f32's fast path: MUFU.RCP refined by one Newton step.
__device__ __forceinline__ float DivisionReciprocal(float b) {
  float r0;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(b));
  return __fmaf_rn(r0, __fmaf_rn(-b, r0, 1.0f), r0);
}

// a / b with y = DivisionReciprocal(b): the fast path of div.rn.f32 (quotient, then one exact fma
// residual correction). Equal to __fdiv_rn(a, b) for b in [2^-49, 2^40] and |a| in [2^-60, 2^60] or
// a = 0; the residual is negated so that a = +-0 gives +-0 like IEEE division with b > 0. Below 2^-60
// the result keeps the sign and stays under 2^-39 in magnitude. A NaN y makes every quotient NaN.
__device__ __forceinline__ float DivideFast(float a, float b, float y) {
  const float q0 = __fmul_rn(a, y);
  const float t = __fmaf_rn(b, q0, -a);  // -(a - b q0), exact
  return __fmaf_rn(-y, t, q0);
}

// The fast path's domain (header comment). lambda in [2^-20, 2^20] keeps every |x| behind a |X̂| below
// 2^40 under 2^60. A group whose absmax is at least kTinyAbsmax has its absmax from an exact quotient
// and is blind to the tiny ones (|x| < 2^-60, bf16 only; their fast quotients keep the sign and stay
// below 2^-39): those give q = 0 (int4: |X̂ / scale| < 2^-16) or an fp8 zero of the right sign
// (|X̂ / scale| < 2^-10.1, below half the smallest e4m3 subnormal), whatever their last bits.
constexpr float kLambdaMin = 0x1p-20f, kLambdaMax = 0x1p20f;
constexpr float kSmoothedMax = 0x1p40f;
constexpr float kTinyAbsmax = 0x1p-20f;

__device__ __forceinline__ float TableReciprocal(float lambda) {
  return lambda >= kLambdaMin && lambda <= kLambdaMax ? DivisionReciprocal(lambda) : __int_as_float(0x7fc00000);
}

// ---- element types --------------------------------------------------------------------------------

template <class T>
struct Half;
template <>
struct Half<__nv_bfloat16> {
  // bf16 -> fp32 is a 16-bit shift, exact.
  static __device__ __forceinline__ void Unpack(uint32_t w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
  }
  static __device__ __forceinline__ uint16_t Round(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
  static __device__ __forceinline__ float Widen(uint16_t bits) {
    return __uint_as_float(static_cast<uint32_t>(bits) << 16);
  }
  // bf16 reaches down to 2^-133: inputs below the fast division's domain exist.
  static constexpr bool kCanBeTiny = true;
  static constexpr float kMinNormal = 0x1p-126f;
};
template <>
struct Half<__half> {
  static __device__ __forceinline__ void Unpack(uint32_t w, float& lo, float& hi) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w));
    lo = f.x;
    hi = f.y;
  }
  static __device__ __forceinline__ uint16_t Round(float v) { return __half_as_ushort(__float2half_rn(v)); }
  static __device__ __forceinline__ float Widen(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }
  // |x| >= 2^-24 when nonzero: always inside the fast division's domain.
  static constexpr bool kCanBeTiny = false;
  static constexpr float kMinNormal = 0x1p-14f;
};

// ---- quantizer ------------------------------------------------------------------------------------

constexpr int kUnitWords = kUnitK / 2;  // 32-bit words of X in a unit

template <ActFormat kFormat>
struct Format {
  static constexpr bool kFp8 = kFormat == ActFormat::kFp8;
  static constexpr int kGroupLanes = (kFp8 ? 128 : 64) / kUnitK;  // quantizer lanes per group
  static constexpr int kUnitQBytes = kUnitK;  // q bytes of a unit: one e4m3 code per value
};

// Where this thread's units live in global memory: unit i of chunk c is at base + c * (bytes per
// chunk) + i * step, row first_row + i * kQuantRowStep of the block. Offsets inside a row block fit
// 32 bits (K <= 2^22).
struct ThreadRows {
  uint8_t* q;
  uint8_t* scale;  // scale of the group this lane computes (lane u < kUnits of its group: unit u)
  float2* record;  // promotion record of this lane's 64-group in its first row (stored by its first lane), or nullptr
  uint32_t q_step;
  uint32_t record_step;  // records between those of units i and i + 1
  int rows_left;  // rows from first_row to M (unit i is inside M iff i * kQuantRowStep < rows_left)
};

// The 16 columns of this thread's unit column: lambda and its table reciprocal.
struct ColumnLambdas {
  float value[kUnitK];
  float reciprocal[kUnitK];
};

// Float index of column c (0..127) in a half of the column table: the four float4 quads of a unit column's 16
// columns are interleaved with the other unit columns' (quad q of unit column u at float 4 (8 q + u)), so one
// LDS.128 of LoadColumnLambdas reads 128 contiguous bytes for a warp's 8 unit columns. Unit-column-major, it
// read 8 quads 64 bytes apart (16 wavefronts instead of 4) and, at M = 4096, K = 12288, those loads were 45%
// of the kernel's shared-memory wavefronts (ncu, session 22).
__host__ __device__ constexpr int TableIndex(int column) {
  const int u = column / kUnitK, j = column % kUnitK;
  return (j / 4 * kUnitsPerRow + u) * 4 + j % 4;
}

__device__ __forceinline__ ColumnLambdas LoadColumnLambdas(uint32_t table, int unit_column) {
  ColumnLambdas c;
#pragma unroll
  for (int j = 0; j < kUnitK; j += 4) {
    const float4 l = LdShared128f(table + TableIndex(unit_column * kUnitK + j) * 4);
    const float4 r = LdShared128f(table + (kChunkK + TableIndex(unit_column * kUnitK + j)) * 4);
    c.value[j] = l.x, c.value[j + 1] = l.y, c.value[j + 2] = l.z, c.value[j + 3] = l.w;
    c.reciprocal[j] = r.x, c.reciprocal[j + 1] = r.y, c.reciprocal[j + 2] = r.z, c.reciprocal[j + 3] = r.w;
  }
  return c;
}

// Group absmax over the group's lanes (4 for int4/uint4, 8 for fp8).
template <ActFormat kFormat>
__device__ __forceinline__ float GroupMax(float v) {
#pragma unroll
  for (int lanes = 1; lanes < Format<kFormat>::kGroupLanes; lanes *= 2) {
    v = MaxNan(v, __shfl_xor_sync(0xffffffffu, v, lanes));
  }
  return v;
}

// X̂ = fp32(X) / lambda for the thread's units, and each unit's group absmax.
template <class T, ActFormat kFormat, bool kExact, int kUnits>
__device__ __forceinline__ void Smooth(const uint32_t (&raw)[kUnits][kUnitWords], const ColumnLambdas& lambdas,
                                       float (&xh)[kUnits][kUnitK], float (&amax)[kUnits]) {
#pragma unroll
  for (int i = 0; i < kUnits; ++i) {
    float local_max = 0.0f;
#pragma unroll
    for (int w = 0; w < kUnitWords; ++w) {
      float a[2];
      Half<T>::Unpack(raw[i][w], a[0], a[1]);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * w + h;
        const float v = kExact ? __fdiv_rn(a[h], lambdas.value[j])
                               : DivideFast(a[h], lambdas.value[j], lambdas.reciprocal[j]);
        xh[i][j] = v;
        local_max = MaxNan(local_max, fabsf(v));
      }
    }
    amax[i] = GroupMax<kFormat>(local_max);
  }
}

// Whether the fast path computed this unit's group exactly: absmax finite (no NaN from an
// out-of-domain lambda) and below 2^40 and, for bf16, not made of tiny quotients only (an all-zero
// unit is fine).
template <class T>
__device__ __forceinline__ bool FastGroupOk(float amax, const uint32_t (&raw)[kUnitWords]) {
  if constexpr (Half<T>::kCanBeTiny) {
    uint32_t bits = 0;
#pragma unroll
    for (int w = 0; w < kUnitWords; ++w) bits |= raw[w];
    const bool unit_is_zero = (bits & 0x7fff7fffu) == 0;
    return (amax < kSmoothedMax) & ((amax >= kTinyAbsmax) | ((amax == 0.0f) & unit_is_zero));
  }
  return amax < kSmoothedMax;
}

// A group's scale and what the division by it needs.
struct GroupScale {
  float scale;        // int4/uint4: widened from `bits`; fp8: the fp32 scale
  uint16_t bits;      // int4/uint4: the scale in X's dtype
  float divisor;      // scale, or 1 where q must be 0
  float divisor_rcp;  // DivisionReciprocal(divisor), or 0 where q must be 0 (scale 0 or inf)
  bool needs_clamp;   // |X̂ / scale| may round past the code range (subnormal scale)
};

// The fast path divides by the constant code range with 1 / qmax rounded to fp32, an immediate: for 7, 15 and
// 448 it is what DivisionReciprocal returns (a fixed point of its Newton step), so no instructions rebuild it.
template <class T, ActFormat kFormat, bool kExact>
__device__ __forceinline__ GroupScale ScaleOf(float amax) {
  GroupScale g;
  if constexpr (kFormat == ActFormat::kFp8) {
    // scale = absmax / 448 in fp32.
    g.scale = kExact ? __fdiv_rn(amax, 448.0f) : DivideFast(amax, 448.0f, 1.0f / 448.0f);
    g.bits = 0;
  } else {
    // scale = absmax / qmax rounded to X's dtype.
    constexpr float kQmax = kFormat == ActFormat::kUint4 ? 15.0f : 7.0f;
    const float scale_f32 = kExact ? __fdiv_rn(amax, kQmax) : DivideFast(amax, kQmax, 1.0f / kQmax);
    g.bits = Half<T>::Round(scale_f32);
    g.scale = Half<T>::Widen(g.bits);
  }
  // Scale 0 (all-zero group, fp16 underflow) and inf (fp16 overflow: X̂ / inf = 0) give q = 0.
  const bool zero_q = !(g.scale != 0.0f && g.scale < INFINITY);
  g.divisor = zero_q ? 1.0f : g.scale;
  g.divisor_rcp = zero_q ? 0.0f : DivisionReciprocal(g.scale);
  // A scale normal in X's dtype is within 2^-8 of absmax / qmax, so |X̂ / scale| < qmax + 0.5 and rint
  // stays in the code range without a clamp. Only a subnormal scale breaks that (in practice fp16:
  // bf16 scales on the fast path are >= 2^-23). fp8 saturates in the conversion instead.
  g.needs_clamp = kFormat != ActFormat::kFp8 && !zero_q && g.scale < Half<T>::kMinNormal;
  return g;
}

// q bytes of one unit. Fast path: X̂ / divisor with its reciprocal (reciprocal 0: q = 0); exact path:
// __fdiv_rn by the scale. kClamp: clamp before rounding (int4/uint4; exact path, subnormal scales).
template <ActFormat kFormat, bool kExact, bool kClamp>
__device__ __forceinline__ uint4 StoreUnit(const float (&xh)[kUnitK], float divisor, float divisor_rcp, float scale,
                                           uint8_t* q, bool store) {
  const bool zero_q = divisor_rcp == 0.0f;
  auto quotient = [&](float x) {
    if constexpr (kExact) return zero_q ? 0.0f : __fdiv_rn(x, scale);
    return DivideFast(x, divisor, divisor_rcp);  // +-0 where q must be 0
  };
  if constexpr (kFormat == ActFormat::kFp8) {
    // q = e4m3(X̂ / scale), RNE, saturating; scale 0 => q 0 (bytes 0x00, not -0).
    uint32_t packed[kUnitK / 4];
#pragma unroll
    for (int j = 0; j < kUnitK; j += 4) {
      const uint32_t lo =
          __nv_cvt_float2_to_fp8x2(make_float2(quotient(xh[j]), quotient(xh[j + 1])), __NV_SATFINITE, __NV_E4M3);
      const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(quotient(xh[j + 2]), quotient(xh[j + 3])),
                                                   __NV_SATFINITE, __NV_E4M3);
      packed[j / 4] = zero_q ? 0u : lo | (hi << 16);
    }
    const uint4 codes = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    if (store) *reinterpret_cast<uint4*>(q) = codes;
    return codes;
  } else {
    // q = clip(rint(X̂ / scale), lo, hi) as an e4m3 code. v + 1.5 * 2^23 (ulp 1) rounds v to an integer,
    // ties to even; subtracting 1.5 * 2^23 again is exact and gives +0 for a zero (never -0, as the
    // reference encodes the integer 0), so the e4m3 conversion of the integer (-8..15, exact) is the code.
    constexpr bool kUnsigned = kFormat == ActFormat::kUint4;
    constexpr float kLo = kUnsigned ? 0.0f : -8.0f, kHi = kUnsigned ? 15.0f : 7.0f;
    constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
    auto integer = [&](float x) {
      float v = quotient(x);
      if constexpr (kClamp) {
        v = fminf(fmaxf(v, kLo), kHi);
      } else if constexpr (kUnsigned) {
        v = fmaxf(v, 0.0f);  // negative X̂ saturate to 0
      }
      return __fadd_rn(__fadd_rn(v, kRound), -kRound);
    };
    uint32_t packed[kUnitK / 4];
#pragma unroll
    for (int j = 0; j < kUnitK; j += 4) {
      const uint32_t lo =
          __nv_cvt_float2_to_fp8x2(make_float2(integer(xh[j]), integer(xh[j + 1])), __NV_SATFINITE, __NV_E4M3);
      const uint32_t hi =
          __nv_cvt_float2_to_fp8x2(make_float2(integer(xh[j + 2]), integer(xh[j + 3])), __NV_SATFINITE, __NV_E4M3);
      packed[j / 4] = lo | (hi << 16);
    }
    const uint4 codes = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    if (store) *reinterpret_cast<uint4*>(q) = codes;
    return codes;
  }
}

// The W4A4 linear's promotion records (ThreadRows::record): the unit's 16 code values summed, then the 64-group's
// 4 lanes (unit columns 4g..4g+3, neighbouring lanes for every format), stored with the group's scale by the
// group's first lane. Warp-uniform: every lane shuffles.
__device__ __forceinline__ void StorePromotionRecord(const uint4& codes, float scale, float2* record, bool store) {
  float s = SumE4m3x16(codes);
  s += __shfl_xor_sync(0xffffffffu, s, 1);
  s += __shfl_xor_sync(0xffffffffu, s, 2);
  if (store && (threadIdx.x & 3) == 0) *record = PromotionRecord(s, scale);
}

template <ActFormat kFormat>
__device__ __forceinline__ void StoreScale(const GroupScale& g, uint8_t* scale) {
  if constexpr (kFormat == ActFormat::kFp8) {
    *reinterpret_cast<float*>(scale) = g.scale;
  } else {
    *reinterpret_cast<uint16_t*>(scale) = g.bits;
  }
}

template <ActFormat kFormat, bool kClamp, int kUnits, int kRowStep>
__device__ __forceinline__ void StoreUnitsFast(const float (&xh)[kUnits][kUnitK], const float (&divisor)[kUnits],
                                               const float (&divisor_rcp)[kUnits], const float (&scale)[kUnits],
                                               const ThreadRows& rows, uint32_t q_chunk, uint32_t record_chunk,
                                               bool col_valid) {
#pragma unroll
  for (int i = 0; i < kUnits; ++i) {
    const bool inside = col_valid && i * kRowStep < rows.rows_left;
    const uint4 codes = StoreUnit<kFormat, false, kClamp>(xh[i], divisor[i], divisor_rcp[i], 0.0f,
                                                          rows.q + (q_chunk + i * rows.q_step), inside);
    if (rows.record != nullptr) {
      StorePromotionRecord(codes, scale[i], rows.record + (record_chunk + i * rows.record_step), inside);
    }
  }
}

// Quantizes kUnits units of a staged chunk (rows first_row + i * kRowStep of the block, unit column
// u = thread % 8) with the column lambdas already in registers.
template <class T, ActFormat kFormat, int kUnits, int kRowStep>
__device__ __forceinline__ void QuantizeUnits(uint32_t x_unit, const ColumnLambdas& lambdas, const ThreadRows& rows,
                                              int unit_column, uint32_t q_chunk, uint32_t scale_chunk,
                                              uint32_t scale_step, uint32_t record_chunk, bool col_valid) {
  using F = Format<kFormat>;
  // This lane's position in its group: on the fast path lane u < kUnits computes (and stores) the
  // scale of unit u for the whole group; on the exact path lane 0 stores them all.
  const int group_lane = unit_column % F::kGroupLanes;
  auto load_units = [&](uint32_t (&raw)[kUnits][kUnitWords]) {
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      // The unit's pieces 2u and 2u + 1 are neighbouring swizzle chunks (XPieceOffset): the second at the
      // first ^ 16 (the tile is 1 KB-aligned and rows are 256 bytes, so bit 4 is the chunk's).
      const uint32_t lo_addr = x_unit + i * kRowStep * kXRowBytes;
      const uint4 lo = LdShared128(lo_addr);
      const uint4 hi = LdShared128(lo_addr ^ kPieceBytes);
      raw[i][0] = lo.x, raw[i][1] = lo.y, raw[i][2] = lo.z, raw[i][3] = lo.w;
      raw[i][4] = hi.x, raw[i][5] = hi.y, raw[i][6] = hi.z, raw[i][7] = hi.w;
    }
  };
  auto unit_inside = [&](int i) { return col_valid && i * kRowStep < rows.rows_left; };
  float xh[kUnits][kUnitK], amax[kUnits];
  bool fast_ok = true;
  {
    uint32_t raw[kUnits][kUnitWords];
    load_units(raw);
    Smooth<T, kFormat, false>(raw, lambdas, xh, amax);
#pragma unroll
    for (int i = 0; i < kUnits; ++i) fast_ok &= !col_valid | FastGroupOk<T>(amax[i], raw[i]);
  }
  if (__all_sync(0xffffffffu, fast_ok)) {
    // Lane u < kUnits of each group computes unit u's scale and shares it with the group.
    float my_amax = amax[0];
#pragma unroll
    for (int i = 1; i < kUnits; ++i) my_amax = group_lane == i ? amax[i] : my_amax;
    const GroupScale mine = ScaleOf<T, kFormat, false>(my_amax);
    if (group_lane < kUnits && unit_inside(group_lane)) StoreScale<kFormat>(mine, rows.scale + scale_chunk);
    const int group_base = (threadIdx.x & 31) - group_lane;
    float divisor[kUnits], divisor_rcp[kUnits], scale[kUnits] = {};
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      divisor[i] = __shfl_sync(0xffffffffu, mine.divisor, group_base + i);
      divisor_rcp[i] = __shfl_sync(0xffffffffu, mine.divisor_rcp, group_base + i);
      if (rows.record != nullptr) scale[i] = __shfl_sync(0xffffffffu, mine.scale, group_base + i);
    }
    if (!__any_sync(0xffffffffu, group_lane < kUnits && mine.needs_clamp)) {
      StoreUnitsFast<kFormat, false, kUnits, kRowStep>(xh, divisor, divisor_rcp, scale, rows, q_chunk, record_chunk,
                                                        col_valid);
    } else {
      StoreUnitsFast<kFormat, true, kUnits, kRowStep>(xh, divisor, divisor_rcp, scale, rows, q_chunk, record_chunk,
                                                        col_valid);
    }
  } else {
    // Rare (values or lambdas outside the fast division's domain): redo with __fdiv_rn.
    uint32_t raw[kUnits][kUnitWords];
    load_units(raw);
    Smooth<T, kFormat, true>(raw, lambdas, xh, amax);
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      const GroupScale g = ScaleOf<T, kFormat, true>(amax[i]);
      if (group_lane == 0 && unit_inside(i)) StoreScale<kFormat>(g, rows.scale + (scale_chunk + i * scale_step));
      const uint4 codes = StoreUnit<kFormat, true, true>(xh[i], g.divisor, g.divisor_rcp, g.scale,
                                                         rows.q + (q_chunk + i * rows.q_step), unit_inside(i));
      if (rows.record != nullptr) {
        StorePromotionRecord(codes, g.scale, rows.record + (record_chunk + i * rows.record_step), unit_inside(i));
      }
    }
  }
}

// Quantizes this thread's kPasses x kUnits units of a staged chunk: the column lambdas are loaded once,
// then each pass takes the next kUnits rows of the thread (rows first_row + i * kRowStep).
template <class T, ActFormat kFormat, int kUnits, int kPasses, int kRowStep>
__device__ __forceinline__ void QuantizeChunk(uint32_t x_unit, uint32_t table, const ThreadRows& rows,
                                              int unit_column, uint32_t q_chunk, uint32_t scale_chunk,
                                              uint32_t scale_step, uint32_t record_chunk, bool col_valid) {
  // Not unrolled: one pass of X̂ and column lambdas live at a time keeps the instance within its register
  // cap (other warps, not unrolling, hide each pass's shuffle latency).
#pragma unroll 1
  for (int pass = 0; pass < kPasses; ++pass) {
    const ColumnLambdas lambdas = LoadColumnLambdas(table, unit_column);
    constexpr int kPassRows = kUnits * kRowStep;
    ThreadRows pass_rows = rows;
    pass_rows.q = rows.q + pass * kUnits * rows.q_step;
    pass_rows.scale = rows.scale + pass * kUnits * scale_step;
    if (rows.record != nullptr) pass_rows.record = rows.record + pass * kUnits * rows.record_step;
    pass_rows.rows_left = rows.rows_left - pass * kPassRows;
    QuantizeUnits<T, kFormat, kUnits, kRowStep>(x_unit + pass * kPassRows * kXRowBytes, lambdas, pass_rows,
                                                unit_column, q_chunk, scale_chunk, scale_step, record_chunk, col_valid);
  }
}

// ---- kernel ---------------------------------------------------------------------------------------

// Grid: row blocks x p.k_splits. Each CTA writes the q and scales of its rows and chunks; LA as below.
template <class T, ActFormat kFormat, int kBlockRows, int kRankCap>
__global__ void __launch_bounds__(TileConfig<kBlockRows, kRankCap>::kThreads, TileConfig<kBlockRows, kRankCap>::kCtasPerSm)
    ActQuantKernel(const __grid_constant__ CUtensorMap tm_x, const __grid_constant__ CUtensorMap tm_lora,
                   const __grid_constant__ Params p) {
  using Cfg = TileConfig<kBlockRows, kRankCap>;
  using F = Format<kFormat>;
  // The W4A4 linear launches its GEMM right after this kernel with programmatic dependent launch: the GEMM
  // starts while this kernel runs and waits for it before its first copy.
  ptx::LaunchDependents();
  extern __shared__ __align__(128) uint8_t smem[];
  // The X tiles are 128-byte-swizzled TMA destinations: 1 KB-aligned (the plan's slack).
  const uint32_t smem_base = tma::SwizzledSharedBase(smem);
  const uint32_t table_base = smem_base + Cfg::kTableOffset;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kBlockRows;
  const int split = blockIdx.y;  // K range index
  const int chunk_begin = static_cast<int>(static_cast<int64_t>(p.num_chunks) * split / p.k_splits);
  const int chunk_end = static_cast<int>(static_cast<int64_t>(p.num_chunks) * (split + 1) / p.k_splits);
  const int num_local_chunks = chunk_end - chunk_begin;
  const uint32_t k = p.k;
  const int64_t rows_left_in_block = p.rows - row0;

  const int rows_left = static_cast<int>(rows_left_in_block < kBlockRows ? rows_left_in_block : kBlockRows);

  // Quantizer: unit column u = t % 8 of rows t / 8 + i * kQuantRowStep.
  const int unit_column = tid % kUnitsPerRow;
  const int first_row = tid / kUnitsPerRow;
  const uint32_t x_unit = XPieceOffset(first_row, 2 * unit_column);
  const int group_lane = unit_column % F::kGroupLanes;
  const uint32_t q_row_bytes = k;  // one byte per value
  const uint32_t scale_row_bytes = F::kFp8 ? k / 128 * 4 : k / 64 * 2;
  const uint32_t scale_step = Cfg::kQuantRowStep * scale_row_bytes;
  ThreadRows rows;
  rows.q = p.q + (row0 + first_row) * q_row_bytes + unit_column * F::kUnitQBytes;
  // The scale this lane may store on the fast path: unit group_lane's row, this lane's group.
  rows.scale = p.scales + (row0 + first_row) * scale_row_bytes + group_lane * scale_step +
               (F::kFp8 ? 0 : unit_column / F::kGroupLanes * 2);
  rows.q_step = Cfg::kQuantRowStep * q_row_bytes;
  // The W4A4 linear's promotion records, (rows, k/64): this lane's 64-group of its first row.
  const uint32_t records_per_row = k / 64;
  rows.record = !ActQuantBlockRowsWritePromotionRecords(kBlockRows) || p.promotion_records == nullptr
                    ? nullptr
                    : p.promotion_records + (row0 + first_row) * records_per_row + unit_column / 4;
  rows.record_step = Cfg::kQuantRowStep * records_per_row;
  rows.rows_left = rows_left - first_row;

  const int rank = kRankCap == 0 ? 0 : p.rank;
  // L_down slabs holding ranks below `rank` (the others are never read: their column pairs are past it).
  const int lora_slabs = [&] {
    if constexpr (kRankCap == 0) return 0;
    else return (rank + Cfg::Lora::kSlabRanks - 1) / Cfg::Lora::kSlabRanks;
  }();

  auto x_tile = [&](int slot) { return smem_base + slot * Cfg::kXTileBytes; };
  auto lambdas = [&](int slot) { return smem_base + Cfg::kLambdaRingOffset + slot * Cfg::kLambdaBytes; };
  auto lora_tile = [&](int slot) { return smem_base + Cfg::kLoraRingOffset + slot * Cfg::kLoraTileBytes; };
  auto table = [&](int chunk_index) { return table_base + (chunk_index & 1) * (2 * kChunkK * 4); };
  auto full_barrier = [&](int slot) {
    return smem_base + Cfg::kBarrierOffset + slot * static_cast<uint32_t>(budget::kMbarrierBytes);
  };

  // Thread 0: chunk `chunk`'s X tile and L_down slabs (TMA) and the next chunk's lambdas (bulk copy) into a
  // stage, on its full barrier. Boxes are always whole: rows past M, k past K and ranks past `rank` arrive
  // as zeros and count.
  const uint64_t evict_first = ptx::L2EvictFirstPolicy();
  auto issue_chunk = [&](int slot, int chunk) {
    const int k_begin = chunk * kChunkK;
    const int k_next = k_begin + kChunkK;
    const uint32_t lambda_bytes = chunk + 1 < chunk_end && k_next < p.k ? min(kChunkK, p.k - k_next) * 4 : 0;
    tma::MbarArriveExpectTx(full_barrier(slot),
                            Cfg::kXTileBytes + lambda_bytes + lora_slabs * Cfg::Lora::kSlabBytes);
    tma::TmaLoad3dHint(tm_x, x_tile(slot), full_barrier(slot), 0, k_begin / kXHalfK, static_cast<int>(row0),
                       evict_first);
    for (int slab = 0; slab < lora_slabs; ++slab) {
      tma::TmaLoad2d(tm_lora, lora_tile(slot) + slab * Cfg::Lora::kSlabBytes, full_barrier(slot),
                     slab * Cfg::Lora::kSlabRanks, k_begin);
    }
    if (lambda_bytes > 0) tma::BulkLoad(lambdas(slot), p.smooth + k_next, lambda_bytes, full_barrier(slot));
  };

  // Low-rank: this warp's 16-row tile and n16 column pairs; per-lane ldmatrix offsets inside a tile.
  // A: row (lane % 16), piece 2 ks + lane / 16 = half ks / 4, chunk 2 (ks % 4) + lane / 16:
  // XPieceOffset is a_lane[ks / 4] ^ ((ks % 4) << 5).
  const int row_tile = warp % Cfg::kRowTiles;
  const int col_group = warp / Cfg::kRowTiles;
  const int num_pairs = rank / 16;
  const int a_row = row_tile * 16 + (lane & 15);
  const uint32_t a_lane[2] = {XPieceOffset(a_row, lane >> 4), XPieceOffset(a_row, 8 + (lane >> 4))};
  // B (ldmatrix.trans): row (lane % 8) + 8 ((lane / 8) % 2) of the k16 step, piece 2 pair + lane / 16;
  // the swizzle depends on the row within the step only (steps are 16 rows).
  uint32_t b_lane[Cfg::kPairsPerWarp > 0 ? Cfg::kPairsPerWarp : 1];
#pragma unroll
  for (int pp = 0; pp < Cfg::kPairsPerWarp; ++pp) {
    b_lane[pp] = Cfg::Lora::PieceOffset((lane & 7) + ((lane >> 3) & 1) * 8,
                                        2 * (col_group + pp * Cfg::kColGroups) + (lane >> 4));
  }
  float acc[Cfg::kPairsPerWarp > 0 ? Cfg::kPairsPerWarp : 1][2][4] = {};

  // A fragment loaded once per k16 step for all of the warp's column pairs; each accumulator still sums
  // the steps in k order. kAllPairs (the rank fills the instance's cap, the common case): no per-pair exit,
  // straight-line code whose ldmatrix loads ptxas issues ahead of the MMAs. With the warp-uniform exit every
  // step waited on its own loads: at M = K = 4096, r = 32 the chunk's 8 steps held 26% of the stall samples
  // (short scoreboard on each MMA's ldmatrix; session 21).
  auto low_rank_steps = [&](int slot, auto all_pairs) {
    constexpr bool kAllPairs = decltype(all_pairs)::value;
#pragma unroll
    for (int ks = 0; ks < kChunkK / 16; ++ks) {
      uint32_t a[4];
      // The XOR is applied to the tile's address (1 KB-aligned: bits 4-6 are a_lane's), so ptxas cannot hoist
      // eight XORed lane offsets out of the chunk loop into live registers (it did: 20 bytes of spills
      // with two units per pass).
      LdMatrixX4(a, (x_tile(slot) + a_lane[ks / 4]) ^ ((ks % 4) << 5));
#pragma unroll
      for (int pp = 0; pp < Cfg::kPairsPerWarp; ++pp) {
        const int pair = col_group + pp * Cfg::kColGroups;
        if (!kAllPairs && pair >= num_pairs) break;  // warp-uniform
        uint32_t b[4];
        LdMatrixX4Trans(b, lora_tile(slot) + ks * 16 * Cfg::Lora::kSlabRowBytes + b_lane[pp]);
        Mma16816<T>(acc[pp][0], a, b[0], b[1]);
        Mma16816<T>(acc[pp][1], a, b[2], b[3]);
      }
    }
  };
  auto low_rank_chunk = [&](int slot) {
    if constexpr (kRankCap > 0) {
      if (num_pairs == Cfg::kPairsPerWarp * Cfg::kColGroups) {
        low_rank_steps(slot, std::true_type{});
      } else {
        low_rank_steps(slot, std::false_type{});
      }
    }
  };

  // This CTA's sum over its chunks: LA itself, or with a K split its partial in the workspace (whole rows:
  // the reduction reads them as float4s), then the arrival at the row block's counter (one per row block).
  // Called once the last chunk's low-rank MMAs are done, before that chunk is quantized: thread 0's release
  // (the arrival's acq_rel atomic) waits for the CTA's stores while the other warps quantize (at the CTA's end
  // it idled all of them: 7% of the stall samples at M = 4096, K = 12288, session 22). Returns ArriveBegin's
  // result for ArriveEnd.
  // LA floats of a row block: LA's rows, or one K split's partial in the workspace.
  auto la_block_floats = [&] { return int64_t{kBlockRows} * rank; };
  auto publish_la = [&]() -> uint32_t {
    if constexpr (kRankCap > 0) {
      const bool split_k = p.k_splits > 1;
      const int64_t block_floats = la_block_floats();
      float* const own = split_k ? p.la_partials + (int64_t{blockIdx.x} * p.k_splits + split) * block_floats
                                 : p.la + row0 * rank;
      const int own_rows = split_k ? kBlockRows : rows_left;
      const int g = lane >> 2, c = lane & 3;
#pragma unroll
      for (int pp = 0; pp < Cfg::kPairsPerWarp; ++pp) {
        const int pair = col_group + pp * Cfg::kColGroups;
        if (pair >= num_pairs) break;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int col = pair * 16 + half * 8 + 2 * c;
#pragma unroll
          for (int rh = 0; rh < 2; ++rh) {
            const int r = row_tile * 16 + g + rh * 8;
            if (r < own_rows) {
              *reinterpret_cast<float2*>(own + r * rank + col) =
                  make_float2(acc[pp][half][2 * rh], acc[pp][half][2 * rh + 1]);
            }
          }
        }
      }
      if (split_k) return ArriveBegin(g_arrival_counters + blockIdx.x);
    }
    return 0;
  };

  // ---- main loop: kStages-deep ring; the column table runs one chunk ahead ----
  // The first chunk's table comes straight from global memory; its lambdas are loaded before the ring's
  // copies, not queued behind them (the table is built while the first chunk is in flight).
  const int first_kk = chunk_begin * kChunkK + tid;
  const bool builds_first_table = tid < kChunkK && num_local_chunks > 0;
  const float first_lambda = builds_first_table && first_kk < p.k ? p.smooth[first_kk] : 0.0f;
  if (tid == 0) {
    for (int s = 0; s < Cfg::kStages; ++s) tma::MbarInit(full_barrier(s), 1);  // thread 0's arrive.expect_tx
    tma::FenceMbarInit();
    tma::TmaPrefetch(tm_x);
  }
  __syncthreads();  // the barriers are initialized
#pragma unroll
  for (int s = 0; s < Cfg::kStages - 1; ++s) {
    if (tid == 0 && s < num_local_chunks) issue_chunk(s, chunk_begin + s);
  }
  // Column tid of a chunk's table: its lambda and the lambda's division reciprocal.
  auto write_table_column = [&](uint32_t chunk_table, float lambda) {
    StShared32f(chunk_table + TableIndex(tid) * 4, lambda);
    StShared32f(chunk_table + (kChunkK + TableIndex(tid)) * 4, TableReciprocal(lambda));
  };
  if (builds_first_table) write_table_column(table(0), first_lambda);
  uint32_t earlier_arrivals = num_local_chunks == 0 ? publish_la() : 0;
  uint32_t full_phase = 0;  // parity of the slot's full barrier for chunk i (flips when the slot wraps)
  for (int i = 0, slot = 0; i < num_local_chunks; ++i) {
    const int chunk = chunk_begin + i;
    tma::MbarWait(full_barrier(slot), full_phase);  // chunk i's X and L_down tiles and chunk i + 1's lambdas
    __syncthreads();  // chunk i and table i visible to all; everyone is done with chunk i - 1's slot
    if (tid < kChunkK) {  // table i + 1 from the lambdas staged with chunk i (0 where none were)
      const bool staged = chunk + 1 < chunk_end && (chunk + 1) * kChunkK + tid < p.k;
      write_table_column(table(i + 1), staged ? LdShared32f(lambdas(slot) + tid * 4) : 0.0f);
    }
    const int next = i + Cfg::kStages - 1;  // goes to chunk i - 1's slot
    if (tid == 0 && next < num_local_chunks) issue_chunk(slot == 0 ? Cfg::kStages - 1 : slot - 1, chunk_begin + next);
    low_rank_chunk(slot);
    if (i == num_local_chunks - 1) earlier_arrivals = publish_la();
    QuantizeChunk<T, kFormat, Cfg::kUnits, Cfg::kPasses, Cfg::kQuantRowStep>(
        x_tile(slot) + x_unit, table(i), rows, unit_column, chunk * (kChunkK * F::kUnitQBytes / kUnitK),
        chunk * 4 /* one fp32 or two 16-bit scales per row */, scale_step, chunk * 2 /* records per row */,
        chunk * kChunkK + unit_column * kUnitK < p.k);
    slot = slot + 1 == Cfg::kStages ? 0 : slot + 1;
    full_phase ^= slot == 0;
  }

  // The W4A4 linear's GEMM loads the codes and scales once every CTA has arrived here, before the LA sum.
  if (p.tokens_ready != nullptr) {
    __syncthreads();  // the CTA's stores, before thread 0's release (cumulative through bar.sync)
    if (tid == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p.tokens_ready) : "memory");
  }

  // ---- epilogue: LA ----
  if constexpr (kRankCap > 0) {
    const bool split_k = p.k_splits > 1;
    const int64_t block_floats = la_block_floats();
    if (split_k) {
      if (!ArriveEnd(g_arrival_counters + blockIdx.x, p.k_splits, earlier_arrivals)) return;
      // The split partials, added in a fixed order: kItems quads a thread, or at decode a group of G lanes per
      // quad, lane c adding splits c, c + G, c + 2G, ... in order and the group then adding its lanes' sums by a
      // butterfly; kSplitsInFlight splits' loads in flight a lane (the geometry is ActQuantSum* in
      // act_quant_plan.h, whose rounds the launch plan weighs against the split; session 42: M = 1 takes its 64
      // splits in one round). Loads past the last split add +0, after the real ones.
      constexpr int kItems = ActQuantSumItems(Cfg::kPlan);
      constexpr int kSplitsInFlight = ActQuantSumSplitsInFlight(Cfg::kPlan);
      const float4* partials = reinterpret_cast<const float4*>(p.la_partials + int64_t{blockIdx.x} * p.k_splits * block_floats);
      const int split_quads = static_cast<int>(block_floats / 4);
      const int quads = rows_left * rank / 4;
      const int lanes_per_quad = ActQuantSumLanesPerQuad(kItems, Cfg::kThreads, quads, p.k_splits);
      const int first_split = tid % lanes_per_quad;
      const int first_item = tid / lanes_per_quad;
      float4 sum[kItems] = {};
      for (int s0 = first_split; s0 < p.k_splits; s0 += kSplitsInFlight * lanes_per_quad) {
        float4 v[kSplitsInFlight][kItems];
#pragma unroll
        for (int i = 0; i < kSplitsInFlight; ++i) {
#pragma unroll
          for (int j = 0; j < kItems; ++j) {
            const int split_index = s0 + i * lanes_per_quad;
            const int item = first_item + j * Cfg::kThreads;
            const bool valid = split_index < p.k_splits && item < quads;
            v[i][j] = valid ? __ldcg(partials + split_index * split_quads + item) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          }
        }
#pragma unroll
        for (int i = 0; i < kSplitsInFlight; ++i) {
#pragma unroll
          for (int j = 0; j < kItems; ++j) {
            sum[j].x += v[i][j].x;
            sum[j].y += v[i][j].y;
            sum[j].z += v[i][j].z;
            sum[j].w += v[i][j].w;
          }
        }
      }
      // Commutative steps: both lanes of each exchange compute the same sum, so the group ends with one value.
      for (int offset = 1; offset < lanes_per_quad; offset *= 2) {
        sum[0].x += __shfl_xor_sync(0xffffffffu, sum[0].x, offset);
        sum[0].y += __shfl_xor_sync(0xffffffffu, sum[0].y, offset);
        sum[0].z += __shfl_xor_sync(0xffffffffu, sum[0].z, offset);
        sum[0].w += __shfl_xor_sync(0xffffffffu, sum[0].w, offset);
      }
      float4* la = reinterpret_cast<float4*>(p.la + row0 * rank);
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        const int item = first_item + j * Cfg::kThreads;
        if (first_split == 0 && item < quads) la[item] = sum[j];
      }
    }
  }
}

// ---- launch ---------------------------------------------------------------------------------------

constexpr int kMaxDevices = 64;

// One kernel instance: its function attributes (set once per device: an attribute is a property of the
// device's context), then the launch on a grid of row blocks x K splits.
template <class T, ActFormat kFormat, int kBlockRows, int kRankCap>
cudaError_t LaunchInstance(const Params& params, const void* x, const void* lora_down, int64_t row_blocks,
                           cudaStream_t stream) {
  using Cfg = TileConfig<kBlockRows, kRankCap>;
  constexpr auto kKernel = ActQuantKernel<T, kFormat, kBlockRows, kRankCap>;
  static std::atomic<bool> configured[kMaxDevices] = {};
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  if (device >= kMaxDevices || !configured[device].load(std::memory_order_acquire)) {
    // More than 48 KB of dynamic shared memory, and the largest carveout so that kCtasPerSm CTAs fit.
    status = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
    if (status == cudaSuccess) {
      status = cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    }
    if (status != cudaSuccess) return status;
    if (device < kMaxDevices) configured[device].store(true, std::memory_order_release);
  }
  // X as (64 k, k / 64 halves, rows): a box of (64, 2, kBlockRows) is one chunk's tile, rows 256 bytes with
  // the 128-byte swizzle (XPieceOffset).
  CUtensorMap tm_x;
  const uint64_t k = static_cast<uint64_t>(params.k), rows = static_cast<uint64_t>(params.rows);
  if (!tma::EncodeTiled<3>(&tm_x, CU_TENSOR_MAP_DATA_TYPE_UINT16, x, {kXHalfK, k / kXHalfK, rows},
                           {kXHalfK * 2, k * 2}, {kXHalfK, kChunkK / kXHalfK, kBlockRows},
                           CU_TENSOR_MAP_SWIZZLE_128B)) {
    return cudaErrorInvalidValue;
  }
  // L_down as (rank, K): a box of (kSlabRanks, 128) is one slab of a chunk's tile (ranks past `rank` read as
  // zeros). Without a low-rank branch the map stays unused.
  CUtensorMap tm_lora = {};
  if constexpr (kRankCap > 0) {
    using Lora = typename Cfg::Lora;
    const uint64_t rank = static_cast<uint64_t>(params.rank);
    if (!tma::EncodeTiled<2>(&tm_lora, CU_TENSOR_MAP_DATA_TYPE_UINT16, lora_down, {rank, k}, {rank * 2},
                             {Lora::kSlabRanks, kChunkK},
                             Lora::kSlabRowBytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B)) {
      return cudaErrorInvalidValue;
    }
  }
  const dim3 grid(static_cast<unsigned>(row_blocks), static_cast<unsigned>(params.k_splits), 1);
  kKernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(tm_x, tm_lora, params);
  return cudaGetLastError();
}

// The instance of the launch plan's row block and rank bucket.
template <class T, ActFormat kFormat>
cudaError_t LaunchPlanned(const Params& params, const void* x, const void* lora_down, const ActQuantLaunch& launch,
                          cudaStream_t stream) {
  auto for_rows = [&](auto block_rows) {
    constexpr int kBlockRows = decltype(block_rows)::value;
    switch (launch.shape.rank_cap) {
      case 0: return LaunchInstance<T, kFormat, kBlockRows, 0>(params, x, lora_down, launch.row_blocks, stream);
      case 32: return LaunchInstance<T, kFormat, kBlockRows, 32>(params, x, lora_down, launch.row_blocks, stream);
      case 128: return LaunchInstance<T, kFormat, kBlockRows, 128>(params, x, lora_down, launch.row_blocks, stream);
      default: return LaunchInstance<T, kFormat, kBlockRows, 256>(params, x, lora_down, launch.row_blocks, stream);
    }
  };
  return launch.shape.block_rows == 64 ? for_rows(std::integral_constant<int, 64>{})
                                       : for_rows(std::integral_constant<int, 16>{});
}

}  // namespace

cudaError_t LaunchActQuant(const ActQuantArgs& args, cudaStream_t stream) {
  const bool fp8 = args.format == ActFormat::kFp8;
  const int64_t group = fp8 ? 128 : 64;
  // rows < 2^31: TMA coordinates are 32-bit.
  if (args.rows < 0 || args.rows > 0x7fffffff || args.k <= 0 || args.k % group != 0 || args.k > kMaxK) {
    return cudaErrorInvalidValue;
  }
  if (args.rank < 0 || args.rank > kMaxRank || args.rank % 16 != 0 || args.num_sms < 1 || args.num_sms > kMaxNumSms) {
    return cudaErrorInvalidValue;
  }
  if (args.rows == 0) return cudaSuccess;
  const ActQuantLaunch launch = PlanActQuantLaunch(args.rows, args.k, args.rank, args.num_sms);
  if (launch.workspace_bytes > 0 && (args.workspace == nullptr || args.workspace_bytes < launch.workspace_bytes)) {
    return cudaErrorInvalidValue;
  }
  if (args.promotion_records != nullptr && !ActQuantWritesPromotionRecords(launch)) return cudaErrorInvalidValue;
  Params params = {};
  params.smooth = args.smooth;
  params.q = static_cast<uint8_t*>(args.q);
  params.scales = static_cast<uint8_t*>(args.scales);
  params.la = args.la;
  params.rows = args.rows;
  params.k = static_cast<int>(args.k);
  params.rank = static_cast<int>(args.rank);
  params.num_chunks = static_cast<int>((args.k + kChunkK - 1) / kChunkK);
  params.k_splits = launch.k_splits;
  params.tokens_ready = args.tokens_ready;
  params.promotion_records = args.promotion_records;
  if (launch.workspace_bytes > 0) {
    params.la_partials = static_cast<float*>(args.workspace);
  }
  auto dispatch = [&](auto format) {
    constexpr ActFormat kFormat = decltype(format)::value;
    return args.dtype == HalfType::kBf16
               ? LaunchPlanned<__nv_bfloat16, kFormat>(params, args.x, args.lora_down, launch, stream)
               : LaunchPlanned<__half, kFormat>(params, args.x, args.lora_down, launch, stream);
  };
  switch (args.format) {
    case ActFormat::kInt4:
      return dispatch(std::integral_constant<ActFormat, ActFormat::kInt4>{});
    case ActFormat::kUint4:
      return dispatch(std::integral_constant<ActFormat, ActFormat::kUint4>{});
    case ActFormat::kFp8:
      return dispatch(std::integral_constant<ActFormat, ActFormat::kFp8>{});
  }
  return cudaErrorInvalidValue;
}

int64_t ActQuantArmedCounters() { return ArmedArrivalCounters(); }

}  // namespace jax_w4a4::sm90
