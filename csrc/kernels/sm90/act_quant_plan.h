// Shared-memory and occupancy plan of act_quant (csrc/kernels/sm90/act_quant.cu), host-compilable.
// The kernel builds its tile configuration from these plans and static_asserts them; python -m
// jax_w4a4.budget prints them (csrc/common/budget_table.cc); tests/test_budget.py checks the arithmetic.
//
// A CTA owns block_rows rows and a range of 128-wide K chunks; per chunk (one ring stage) it stages the X
// tile (TMA, 128-byte swizzle), with a low-rank branch the L_down tile (TMA, slabs of 64 ranks) and the next
// chunk's 128 lambdas (a bulk copy). Shared memory: the X and L_down rings first (every tile and slab 1
// KB-aligned for the swizzle), then the lambda ring, the column table and a full mbarrier per stage, + 1 KB
// to align the base.
// The plan fixes the CTAs that must be resident on one SM (the occupancy the kernel is designed for: the
// bandwidth comes from several small CTAs per SM, each hiding the others' barriers) and solves the deepest
// ring that lets that many CTAs share the SM's 228 KB. The launch plan (PlanActQuantLaunch) picks the row
// block and the K split from that occupancy, so the FFI lowering can size the split's workspace before any
// launch.
#pragma once

#include <cstdint>

#include "common/arrival_counters.h"
#include "common/smem_budget.h"

namespace jax_w4a4::sm90 {

inline constexpr int kActQuantChunkK = 128;         // k per stage: two int4 groups or one fp8 group
inline constexpr int kActQuantMaxStages = 6;
inline constexpr int kActQuantMinStages = 2;        // one chunk in flight while the previous is computed

struct ActQuantShape {
  int block_rows;  // rows per CTA: 64 (large M) or 16 (small M, K split wider)
  int rank_cap;    // largest low-rank rank the instance serves (0: no low-rank branch)
};

struct ActQuantPlan {
  ActQuantShape shape;
  int warps;
  int threads;
  int ctas_per_sm;     // designed occupancy: __launch_bounds__ min blocks, smem solved for it
  int units_per_pass;  // quantizer: 16-value units per thread per pass (registers for X̂)
  int passes;          // quantizer passes per chunk (the column lambdas are loaded once for all)
  int stages;
  int64_t x_tile_bytes;        // block_rows x 128 halves
  int64_t lambda_bytes;        // the next chunk's 128 lambdas (fp32)
  int64_t lora_row_pitch;      // L_down tile row: rank_cap halves (in slabs of 64 ranks, swizzled)
  int64_t lora_tile_bytes;     // 128 rows of L_down
  int64_t stage_bytes;         // X tile + lambdas + L_down tile
  int64_t ring_bytes;
  int64_t column_table_bytes;  // two chunks of (lambda, reciprocal)
  int64_t barrier_bytes;       // a full mbarrier per stage (the X tile's, L_down tile's and lambdas' bytes)
  int64_t total_bytes;         // dynamic shared memory per CTA, with the 1 KB that aligns the X and L_down rings
  constexpr int64_t per_sm_bytes() const { return ctas_per_sm * (total_bytes + budget::kSmemReservedPerCtaSm90); }
  // The register cap __launch_bounds__(threads, ctas_per_sm) gives ptxas.
  constexpr int max_registers() const { return budget::LaunchRegisters(threads, ctas_per_sm); }
  constexpr bool fits() const {
    return stages >= kActQuantMinStages && total_bytes <= budget::kSmemPerBlockSm90 && per_sm_bytes() <= budget::kSmemPerSmSm90;
  }
};

// Warps per CTA: 64-row blocks with rank <= 32 run 4 warps (a 16-row mma tile each); larger ranks 8
// (two column groups: fewer accumulators per thread). 16-row blocks: 4 warps.
constexpr int ActQuantWarps(ActQuantShape s) { return s.block_rows == 64 && s.rank_cap > 32 ? 8 : 4; }

// Designed CTAs per SM. Large M, rank <= 32 (the bandwidth case): 4 CTAs of 128 threads, 128 registers
// each. Ranks above 32 keep more accumulators (and larger L_down tiles) and run fewer CTAs.
constexpr int ActQuantCtasPerSm(ActQuantShape s) {
  if (s.rank_cap <= 32) return s.block_rows == 64 ? 4 : 3;
  if (s.rank_cap <= 128) return s.block_rows == 64 ? 1 : 2;
  return 1;
}

constexpr ActQuantPlan MakeActQuantPlan(ActQuantShape s, int stages) {
  ActQuantPlan p{};
  p.shape = s;
  p.warps = ActQuantWarps(s);
  p.threads = p.warps * 32;
  p.ctas_per_sm = ActQuantCtasPerSm(s);
  // 8 threads per row (16 values each); threads / 8 rows per unit step. Two units per pass: more
  // independent work between the group shuffles. At 128 registers (4 CTAs per SM) that fits beside the
  // low-rank accumulators because each pass loads its column lambdas from the table instead of keeping a
  // chunk's in registers (session 22: -4% at M = K = 4096, r = 32, -9% in the fp8 format).
  const int units_per_chunk = s.block_rows / (p.threads / 8);
  const int max_units_per_pass = 2;
  p.units_per_pass = units_per_chunk < max_units_per_pass ? units_per_chunk : max_units_per_pass;
  p.passes = p.units_per_pass > 0 ? units_per_chunk / p.units_per_pass : 0;
  p.stages = stages;
  p.x_tile_bytes = int64_t{s.block_rows} * kActQuantChunkK * 2;
  p.lambda_bytes = kActQuantChunkK * 4;
  p.lora_row_pitch = s.rank_cap * 2;
  p.lora_tile_bytes = s.rank_cap == 0 ? 0 : kActQuantChunkK * p.lora_row_pitch;
  p.stage_bytes = p.x_tile_bytes + p.lambda_bytes + p.lora_tile_bytes;
  p.ring_bytes = stages * p.stage_bytes;
  p.column_table_bytes = 2 * 2 * kActQuantChunkK * 4;
  p.barrier_bytes = stages * budget::kMbarrierBytes;
  p.total_bytes = p.ring_bytes + p.column_table_bytes + p.barrier_bytes + budget::kSwizzledAlign;
  return p;
}

// The last CTA's sum of a row block's split partials (act_quant.cu, epilogue: LA), which the launch plan
// weighs against the split. Each thread adds `SumItems` LA quads (4 floats) of the row block; with one item a
// thread and few quads (decode), a group of lanes per quad splits the splits between them (lane c adds splits
// c, c + G, ...; the group then a butterfly). A lane keeps `SumSplitsInFlight` splits' loads in flight (what
// its registers hold), so the sum takes `SumRounds` dependent rounds of L2 loads.
constexpr int ActQuantSumItems(const ActQuantPlan& p) {
  return (p.shape.block_rows * p.shape.rank_cap / 4 + p.threads - 1) / p.threads;
}
constexpr int ActQuantSumSplitsInFlight(const ActQuantPlan& p) {
  const int loads_in_flight = p.max_registers() >= 160 ? 32 : 16;
  const int items = ActQuantSumItems(p);
  return items >= loads_in_flight ? 1 : loads_in_flight / items;
}
// (Scalars, not the plan: the kernel calls it at run time.)
constexpr int ActQuantSumLanesPerQuad(int items, int threads, int quads, int splits) {
  int lanes = 1;
  while (items == 1 && lanes < 16 && 2 * lanes * quads <= threads && 2 * lanes <= splits) lanes *= 2;
  return lanes;
}
constexpr int ActQuantSumRounds(const ActQuantPlan& p, int rows, int64_t rank, int splits) {
  if (rank == 0 || splits == 1) return 0;
  const int lanes = ActQuantSumLanesPerQuad(ActQuantSumItems(p), p.threads, static_cast<int>(rows * rank / 4), splits);
  const int splits_per_lane = (splits + lanes - 1) / lanes;
  const int in_flight = ActQuantSumSplitsInFlight(p);
  return (splits_per_lane + in_flight - 1) / in_flight;
}

// The deepest ring (at most kActQuantMaxStages) with which ctas_per_sm CTAs fit on one SM.
constexpr ActQuantPlan SolveActQuantPlan(ActQuantShape s) {
  for (int stages = kActQuantMaxStages; stages > kActQuantMinStages; --stages) {
    const ActQuantPlan p = MakeActQuantPlan(s, stages);
    if (p.fits()) return p;
  }
  return MakeActQuantPlan(s, kActQuantMinStages);  // the kernel static_asserts fits()
}

// Every instance the launcher dispatches to: row block x rank bucket.
inline constexpr ActQuantShape kActQuantShapes[] = {
    {64, 0}, {64, 32}, {64, 128}, {64, 256}, {16, 0}, {16, 32}, {16, 128}, {16, 256},
};

// ---- launch plan ----------------------------------------------------------------------------------
//
// K split: the split CTAs of a row block quantize disjoint chunks and, with a low-rank branch, leave
// fp32 LA partials in the workspace; the last of them to finish (an arrival counter per row block,
// common/arrival_counters.h) sums them in split order, so LA does not depend on the arrival order. No
// thread-block cluster: clusters are placed whole inside a GPC, and on a 132-SM H200 64 clusters of 8 CTAs
// at 4 CTAs per SM do not fit in one wave (benchmarks/NOTES.md, session 7: the cluster version had to halve its
// split and ran 2 warps per scheduler instead of 4).
inline constexpr int kActQuantMaxSplits = 32;     // the last CTA reads splits x block_rows x rank floats
inline constexpr int kActQuantMinSplitChunks = 2;  // chunks per split CTA: its ring overlaps copy and compute
inline constexpr int kActQuantMaxIdleSmSplits = 64;  // the split on idle SMs (below), down to one chunk a CTA

constexpr int ActQuantRankCap(int64_t rank) { return rank == 0 ? 0 : rank <= 32 ? 32 : rank <= 128 ? 128 : 256; }

struct ActQuantLaunch {
  ActQuantShape shape;
  int64_t row_blocks;
  int k_splits;
  int64_t arrival_counters;  // one per row block when partials are summed (<= kArrivalCounters), else 0
  int64_t workspace_bytes;   // row_blocks x k_splits x block_rows x rank fp32 LA partials: 0 when nothing
                             // is reduced across CTAs (no split, or rank 0)
};

// Whether the launch can write the W4A4 linear's promotion records (ActQuantArgs::promotion_records): only the
// decode instances (16-row blocks) carry that code, which would cost the 64-row instances registers (spills at
// their 128 cap).
constexpr bool ActQuantBlockRowsWritePromotionRecords(int block_rows) { return block_rows == 16; }
constexpr bool ActQuantWritesPromotionRecords(const ActQuantLaunch& launch) {
  return ActQuantBlockRowsWritePromotionRecords(launch.shape.block_rows);
}

// The largest power-of-two split worth taking for num_chunks chunks of K.
constexpr int ActQuantSplitCap(int num_chunks) {
  int cap = 1;
  while (2 * cap <= kActQuantMaxSplits && 2 * cap * kActQuantMinSplitChunks <= num_chunks) cap *= 2;
  return cap;
}

// The CTAs the GPU holds at once for one instance: the designed occupancy, which the kernel's
// __launch_bounds__ (registers) and its static_assert'ed plan (shared memory) guarantee.
constexpr int64_t ActQuantResidentCtas(ActQuantShape s, int num_sms) { return int64_t{num_sms} * ActQuantCtasPerSm(s); }

// Row block: 64 rows (the L_down tile is shared by 64 rows) from kActQuantLargeMinRowBlocks of them, or when
// fewer, split along K, fill the resident CTAs; else 16 rows (decode). Split: the smallest power of two whose
// grid fills the resident CTAs (within 10%), cut back to one wave where the doubling overshoots it (any count:
// the split CTAs take contiguous chunk ranges of equal size to within one chunk).
// Measured (benchmarks/NOTES.md, session 41, us at rank 32, before -> after): the 16-row blocks at 1024-3072
// rows had run 1.3 waves or 16 rows a CTA, 2048 x 3072 23.1 -> 13.0, 3072 x 3072 23.1 -> 16.0, 1024 x 4096
// 16.8 -> 11.2, 1024 x 3072 13.9 -> 10.2; one wave alone: 512 x 4096 11.5 -> 8.7.
// Then, while the doubled grid still has at most one CTA per SM, the split doubles on, down to one chunk a CTA
// (at most kActQuantMaxIdleSmSplits): the new CTAs run on idle SMs, and at decode a CTA's time follows the bytes
// it pulls alone (session 42, us: 1 x 3072 5.6 -> 4.8, 7 x 3072 5.6 -> 4.9, 1 x 28672 10.4 -> 8.3). A doubling
// is taken while the chunks it takes off a CTA cost more than the rounds it adds to the last CTA's sum
// (ActQuantIdleSmDoublingPays).
inline constexpr int64_t kActQuantLargeMinRowBlocks = 16;

// Decode costs, fitted on an H200 (session 43, 1-16 rows, ranks 0-256, splits 8-64): a chunk a CTA costs a
// dependent DRAM round trip plus its L_down tile, ~520 ns + 2.5 ns per rank of the cap (rank 0: 2.50 -> 1.98 us
// for 2 -> 1 chunks at 1 x 8192); a round of the sum's loads ~450 ns (16 x 8192 at rank 128: 64 splits, one
// chunk and 8 rounds, 9.5 us; 32 splits, two chunks and 4 rounds, 8.0).
inline constexpr int kActQuantChunkNs = 520;
inline constexpr int kActQuantChunkNsPerTwoRanks = 5;
inline constexpr int kActQuantSumRoundNs = 450;

constexpr bool ActQuantIdleSmDoublingPays(ActQuantShape s, int64_t rows, int64_t rank, int num_chunks, int splits) {
  const ActQuantPlan plan = SolveActQuantPlan(s);
  const int rows_in_block = static_cast<int>(rows < s.block_rows ? rows : s.block_rows);
  const int chunks_saved = (num_chunks + splits - 1) / splits - (num_chunks + 2 * splits - 1) / (2 * splits);
  const int rounds_added =
      ActQuantSumRounds(plan, rows_in_block, rank, 2 * splits) - ActQuantSumRounds(plan, rows_in_block, rank, splits);
  const int chunk_ns = kActQuantChunkNs + kActQuantChunkNsPerTwoRanks * s.rank_cap / 2;
  return chunks_saved * chunk_ns > rounds_added * kActQuantSumRoundNs;
}

constexpr ActQuantLaunch PlanActQuantLaunch(int64_t rows, int64_t k, int64_t rank, int num_sms) {
  ActQuantLaunch launch{};
  const int num_chunks = static_cast<int>((k + kActQuantChunkK - 1) / kActQuantChunkK);
  const int split_cap = ActQuantSplitCap(num_chunks);
  const int rank_cap = ActQuantRankCap(rank);
  const ActQuantShape large{64, rank_cap}, small{16, rank_cap};
  const int64_t large_blocks = (rows + 63) / 64;
  const bool use_large = large_blocks >= kActQuantLargeMinRowBlocks ||
                         large_blocks * split_cap >= ActQuantResidentCtas(large, num_sms) * 9 / 10;
  launch.shape = use_large ? large : small;
  launch.row_blocks = (rows + launch.shape.block_rows - 1) / launch.shape.block_rows;
  const int64_t resident = ActQuantResidentCtas(launch.shape, num_sms);
  launch.k_splits = 1;
  while (launch.k_splits < split_cap && launch.row_blocks * launch.k_splits < resident * 9 / 10) launch.k_splits *= 2;
  while (2 * launch.k_splits <= kActQuantMaxIdleSmSplits && 2 * launch.k_splits <= num_chunks &&
         launch.row_blocks * 2 * launch.k_splits <= num_sms &&
         ActQuantIdleSmDoublingPays(launch.shape, rows, rank, num_chunks, launch.k_splits)) {
    launch.k_splits *= 2;
  }
  if (launch.k_splits > 1 && launch.row_blocks * launch.k_splits > resident) {
    launch.k_splits = static_cast<int>(resident / launch.row_blocks);
  }
  if (launch.k_splits > 1 && rank > 0) {
    launch.arrival_counters = launch.row_blocks;
    launch.workspace_bytes = launch.row_blocks * launch.k_splits * launch.shape.block_rows * rank * 4;
  }
  return launch;
}

// A split needs row_blocks < the resident CTAs (the split doubles while the grid is below them), so the
// arrival counters fit the pool for every num_sms the handlers accept.
constexpr bool ActQuantCountersFitPool() {
  for (const ActQuantShape& s : kActQuantShapes) {
    if (ActQuantResidentCtas(s, kMaxNumSms) > kArrivalCounters) return false;
  }
  return true;
}
static_assert(ActQuantCountersFitPool(), "act_quant's arrival counters must fit the pool");

// Workspace of one launch planned for num_sms SMs (the FFI lowering sizes the op's workspace result with it).
constexpr int64_t ActQuantWorkspaceBytes(int64_t rows, int64_t k, int64_t rank, int num_sms) {
  return PlanActQuantLaunch(rows, k, rank, num_sms).workspace_bytes;
}

}  // namespace jax_w4a4::sm90
