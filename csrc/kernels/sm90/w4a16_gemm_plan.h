// Shared-memory and occupancy plan of the w4a16 GEMM (csrc/kernels/sm90/w4a16_gemm.cu) and its launch
// plan (grid, split-K, workspace), host-compilable. The kernel builds its Config from these plans and
// static_asserts them; python -m jax_w4a4.budget prints them (csrc/common/budget_table.cc);
// tests/test_budget.py checks the arithmetic. The launch plan lives here too, so the FFI lowering can size
// the workspace (an XLA-allocated output: CUDA-graph safe) with the launcher's own code.
//
// A CTA owns up to 8 warps x tiles_per_warp m16 tiles of W and 8 x m_tiles tokens; one ring stage is one
// 64-wide K atom, each part one TMA box: 512 B of prepacked weights per m16 tile, the X tile (one 128-byte
// row per token, 128-byte swizzle: the wgmma B operand), and the scales and zero points of the atom's
// groups (two with 32-wide groups) for every row, from their (K/G, N) kernel layout; plus the stage's two
// mbarriers (full, empty). Fixed: 1 KB of slack to align the base for the swizzle. Up to 16 tokens
// (mma.sync) a warp owns 4 m16 tiles (the X fragments, the loop and the barrier serve twice the weights:
// measured −9% at 1 x 28672 x 8192, and at 16 tokens −10% against wgmma with 2 tiles, session 12);
// up to 16 tokens two CTAs share an SM (the other CTA's warps issue while one waits at its barrier);
// past 16 tokens the accumulators need more registers than two CTAs of 256 threads may have, so one CTA
// per SM gets a deeper ring. Whole-SM plans (long splits: PlanW4a16Launch): one CTA per SM of up to
// WholeMaxWarps row warps: at one token tile the two CTAs of a pair merged into one ring, at 16 and 32 tokens the
// wide CTA with twice its tiles a warp (8 and 4: the registers of a CTA alone on its SM; at 16 tokens also 7, in
// kWhole7 plans: 8 warps of 7 tiles). Narrow plans (up to 16
// tokens, layers of up to num_sms x 64 rows; PlanW4a16Launch says when, NarrowMaxLanes how): one warp's
// rows (narrow32 plans: half a warp's, kNarrow32TilesPerWarp), stages of kNarrowStageAtoms atoms (the X part
// one 3-D box of the M token rows), one CTA per SM; past the ring, the cluster sums: the slots where the
// other CTAs of a K-split cluster (kMaxNarrowCluster) put their accumulators, and their mbarrier.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/arrival_counters.h"
#include "common/smem_budget.h"

namespace jax_w4a4::sm90::w4a16 {

inline constexpr int kAtomRows = 16;                     // one m16 MMA tile of W
inline constexpr int kAtomCols = 64;                     // four k16 MMA steps
inline constexpr int kAtomBytes = kAtomRows * kAtomCols / 2;   // 512 B = 32 lanes x 16 B
inline constexpr int kRowGranule = 32;                   // N % 32: valid m16 tiles in pairs (but kWhole7's warps)
inline constexpr int kMinWarps = 4;
inline constexpr int kMaxWarps = 8;
inline constexpr int kSchedulersPerSm = 4;              // warp schedulers (SM sub-partitions)
inline constexpr int kXRowBytes = kAtomCols * 2;         // 128 B: one swizzle row (8 rows = 1 KB atom)
inline constexpr int kMaxGroupsPerAtom = kAtomCols / 32;  // 32-wide groups: two per atom
inline constexpr int kWidestFixedGroup = 128;             // group sizes 32, 64, 128 (per-channel groups span K)
inline constexpr int kScaleBytes = 2;                    // bf16 / fp16
inline constexpr int kZeroBytes = 1;                     // uint8 zero point
inline constexpr int kMinStages = 4;                     // the ring must hide HBM latency
inline constexpr int kMaxStages = 16;
inline constexpr int kMTileOptions[] = {1, 2, 4, 8};     // n8 token tiles per CTA the kernel instantiates

inline constexpr int kMaxMmaSyncMTiles = 2;              // mma.sync up to 16 tokens, wgmma beyond
constexpr int CtasPerSm(int m_tiles) { return m_tiles <= 2 ? 2 : 1; }  // wide plans

// How a launch's CTAs hold an SM (W4a16Plan::form, W4a16Launch::form).
//   kWide    CtasPerSm(m_tiles) CTAs of up to kMaxWarps row warps, each computing every atom of its K range.
//   kWhole   one CTA of up to WholeMaxWarps(m_tiles) row warps of TilesPerWarp m16 tiles each (the 8-, 16- and
//            32-token tiles: HasForm; PlanW4a16Launch says when).
//   kWhole7  the same with 7 m16 tiles a warp at the 16-token tile: 8 row warps hold kWhole's 896-row CTA of 7
//            warps, whose eighth launched warp owns no rows but runs a row warp's MMAs (W4a16Threads).
//   kNarrow    one CTA of one warp's rows (4 m16 tiles, 64 rows), K shared by k-lanes (mma.sync token tiles;
//              see NarrowMaxLanes).
//   kNarrow32  the same with 2 m16 tiles a warp (32 rows): twice the CTAs, for layers of up to num_sms x 32
//              rows with K of up to kNarrowShortKAtoms atoms a CTA (see kNarrow32TilesPerWarp).
//   Both narrow forms may split K over a cluster of CTAs (W4a16Launch::splits, kMaxNarrowCluster) that add
//   their accumulators through distributed shared memory.
enum class W4a16Form : int { kWide = 0, kWhole = 1, kNarrow = 2, kNarrow32 = 3, kWhole7 = 4 };
constexpr bool IsNarrow(W4a16Form form) { return form == W4a16Form::kNarrow || form == W4a16Form::kNarrow32; }
constexpr bool IsWhole(W4a16Form form) { return form == W4a16Form::kWhole || form == W4a16Form::kWhole7; }
// Whether the kernel instantiates `form` for a token tile: narrow forms for the mma.sync tiles, whole-SM for the 8-
// to 32-token tiles (one token: up to 16 row warps of 4 m16 tiles, 128 registers a thread, as two wide CTAs of 8
// warps; 16 tokens, mma.sync: up to 8 row warps of 8 m16 tiles; 32, wgmma: up to 8 of 4, twice the wide CTA's tiles a
// warp, whose accumulators and partials alone take 128 registers a thread: ptxas 206-254 and 202-211 with the A
// fragments), kWhole7 (8 row warps of 7 tiles, 190-220 registers) for the 16-token tile.
constexpr bool HasForm(int m_tiles, W4a16Form form) {
  switch (form) {
    case W4a16Form::kWide: return true;
    case W4a16Form::kWhole: return m_tiles <= 4;
    case W4a16Form::kWhole7: return m_tiles == 2;
    default: return m_tiles <= kMaxMmaSyncMTiles;
  }
}
inline constexpr W4a16Form kWholeForms[] = {W4a16Form::kWhole, W4a16Form::kWhole7};  // the planner's whole-SM choices
constexpr int WholeMaxWarps(int m_tiles) { return m_tiles == 1 ? 16 : 8; }
// The fewest row warps a whole-SM CTA gets: at one token tile more than a wide CTA's (8 or fewer warps are the
// wide pair's plan); at 32 tokens 7, so that at most one of its two warpgroups' warps owns no rows (such a warp runs
// a row warp's dequantization and MMAs: 6-warp plans lost 3-13% at 32 tokens, session 29; with 4-6 warps of 8 tiles
// at 16 tokens 8192 x 28672 took 46.1 -> 51.0 us and 16384 x 12288 38.9 -> 43.3, session 30); at 16 tokens 8, as
// kWhole7 holds 7 warps' worth of 8 tiles (896 rows) in 8 warps of 7: 16 x 28672 x 8192 43.6-43.9 -> 41.7-41.9 us,
// 16 x 57344 x 8192 78.1-78.2 -> 72.9-73.3 (session 31).
constexpr int WholeMinWarps(int m_tiles) {
  return m_tiles == 1 ? kMaxWarps + 1 : m_tiles == 2 ? WholeMaxWarps(m_tiles) : WholeMaxWarps(m_tiles) - 1;
}
// m16 tiles of W per warp: 4 up to 16 tokens, 2 beyond in wide CTAs (at 16 tokens 4 tiles' accumulators,
// partials and column sums take 126-128 registers: all that two CTAs of 8 warps may have); whole-SM CTAs twice the
// wide CTA's at 16 and 32 tokens (the X fragments, the stage waits and the bookkeeping of an atom serve twice the
// weights; 2 tiles a warp in three CTAs of 8 warps an SM lost 20-30% at 16 tokens, session 30), 4 at one token
// (8 a warp in 7 warps ran 1 x 28672 x 8192 no faster: 36.3 -> 36.3-36.4 us); kWhole7 7; narrow32 CTAs 2 at every
// token tile.
inline constexpr int kNarrow32TilesPerWarp = 2;
constexpr int TilesPerWarp(int m_tiles, W4a16Form form = W4a16Form::kWide) {
  if (form == W4a16Form::kNarrow32) return kNarrow32TilesPerWarp;
  if (form == W4a16Form::kWhole) return m_tiles == 2 ? 8 : 4;
  if (form == W4a16Form::kWhole7) return 7;
  return m_tiles <= kMaxMmaSyncMTiles ? 4 : 2;
}
constexpr int WarpRows(int m_tiles, W4a16Form form = W4a16Form::kWide) {
  return TilesPerWarp(m_tiles, form) * kAtomRows;
}
// A warp's accumulators: one float4 of fragment per lane, m16 tile and n8 token tile. The size of a split-K
// partial per warp and of a cluster-sum slot.
constexpr int WarpAccumulatorBytes(int m_tiles, W4a16Form form) {
  return 32 * TilesPerWarp(m_tiles, form) * m_tiles * 16;
}

// Narrow CTAs (mma.sync token tiles only): one CTA per SM owns one warp's rows (64) and the whole of K,
// split over up to NarrowMaxLanes warps ("k-lanes") that take turns on the ring's stages of
// kNarrowStageAtoms atoms (in runs of lane_atoms, below) and add their accumulators through shared memory
// at the end: no split-K partials, no arrival counter, no second CTA per SM. A dedicated producer warp fills
// the ring. Session 15 (benchmarks/NOTES.md): a split-K launch spent ~3 us in the partials' round trips
// (1 x 128 x 512 in 2 splits 5.4 us, 1 x 32 x 64 unsplit 2.5 us), the two CTAs on an SM streamed unevenly
// (1 x 28672 x 8192: 22.8 and 30.1 us for the same bytes), and one-atom stages of 64 rows (2 KB) were bound
// by their TMA issue (~200 ns a stage: 1 x 8192 x 28672 took 96 us).
inline constexpr int kNarrowStageAtoms = 4;              // 8 KB of weights a stage: one TMA box each
// The k-lanes a narrow CTA may launch: 8 at one token tile and in narrow32 CTAs (16 lost 5-7% at one token: 4096² 6.43
// -> 6.85 us, 5120 x 8192 11.5 -> 12.3, 1536 x 28672 11.2 -> 11.8; session 38), 12 at the 16-token narrow tile, whose
// k-lanes each carry twice the MMAs an atom (6 -> 12 lanes at 16 tokens, us: 1536 x 28672 16.1 -> 13.9, 8192 x 8192 as
// narrow CTAs 17.3; 6 -> 8 lanes gave 13.9 and 17.5; session 38). The launch bound of 13 warps holds its instances at
// 128 registers a thread (they use 125-128, no spills).
inline constexpr int kMaxNarrowLanes = 8;
inline constexpr int kMaxNarrowTwoTileLanes = 12;
constexpr int NarrowMaxLanes(int m_tiles, W4a16Form form) {
  return m_tiles == 2 && form == W4a16Form::kNarrow ? kMaxNarrowTwoTileLanes : kMaxNarrowLanes;
}
// A k-lane computes runs of lane_atoms consecutive atoms (W4a16Launch): whole stages, or with K of up to
// kNarrowShortKAtoms atoms runs of kNarrowShortRunAtoms, so that several lanes compute a stage at once and the
// last stage, which no later stream hides, takes a fraction as long. A one-atom run splits a 128-wide group
// between two lanes: each promotes its half (the kernel's kRunsSplitGroups). Session 17 (benchmarks/NOTES.md),
// stages -> runs of 2, 1 / 2 tokens: 8192² 14.1 / 14.3-14.4 -> 13.5-13.6 / 13.9-14.0 us, 2048² 5.8 -> 5.3-5.4
// (with K = 28672 runs of 2 took 36.1 -> 36.7-36.8 us, so long K keeps whole stages); session 35, runs of 2 -> 1,
// 1 / 16 tokens: 4096² 6.68 -> 6.43 / 8.63 -> 8.41 us, 1024 x 4096 5.20 -> 5.00 / 5.67 -> 5.40, 8192² 13.2 -> 12.9.
// Only 64-row narrow CTAs at one token tile have whole-stage runs (the kernel instantiates no other): narrow32 runs
// short K only, and two token tiles take one-atom runs at any K (measured at up to K = 28672 against wide plans,
// session 40, NarrowGainUs below; never against whole-stage runs).
inline constexpr int kNarrowShortRunAtoms = 1;
inline constexpr int kNarrowShortKAtoms = 128;
static_assert(kNarrowStageAtoms % kNarrowShortRunAtoms == 0);
constexpr bool HasStageRuns(int m_tiles, W4a16Form form) { return form == W4a16Form::kNarrow && m_tiles == 1; }
constexpr int NarrowLaneAtoms(int m_tiles, W4a16Form form, int64_t cta_atoms) {
  return HasStageRuns(m_tiles, form) && cta_atoms > kNarrowShortKAtoms ? kNarrowStageAtoms : kNarrowShortRunAtoms;
}
inline constexpr int kMaxNarrowStages = 32;
// Narrow K-split clusters: where fewer narrow CTAs than SMs own all the rows, the CTAs of a row tile split K
// as one cluster of 2 or 4 (W4a16Launch::splits): every CTA but rank 0 stores its lane-0 accumulators into
// rank 0's cluster-sum slots (st.async, counted on rank 0's mbarrier) and exits; rank 0 adds them in rank order
// (deterministic) and stores Y. No workspace, no arrival counter, no global round trip: the ~3 us of a split-K
// launch's partials (session 15) were what kept narrow CTAs unsplit, one per row tile, so layers with few rows
// left most SMs idle (1 x 1024 x 4096: 32 CTAs of 64 KB) or went wide (1 x 4096 x 14336: 14 splits). A cluster
// costs ~0.5 us (its launch, the cluster barrier, the sums), so each CTA keeps kNarrowClusterMinAtoms atoms.
// The ranks split K in granules of 128 columns (SplitGranule). Session 28 (benchmarks/NOTES.md),
// us at M = 1 / 16, unsplit -> clusters of 2: 1024 x 4096 6.4 / 7.0 -> 5.3 / 5.9, 2048 x 8192 9.8 / 11.4 ->
// 7.2 / 8.7, 1024 x 14336 (wide) 11.8 / 15.2 -> 9.8 / 10.8, 4096 x 14336 (wide) 15.0 -> 12.3 at M = 1;
// 512 x 4096 6.1 -> 5.1 (2) -> 4.3 (4); with 8 atoms a CTA 1024² lost (3.7 / 4.1 -> 3.9 / 4.4), with 12
// 576 x 1536 did not gain (4.1 / 4.6 -> 4.1 / 4.5).
inline constexpr int kMaxNarrowCluster = 4;
inline constexpr int kNarrowClusterMinAtoms = 4 * kNarrowStageAtoms;
// Narrow32 CTAs (kNarrow32TilesPerWarp m16 tiles, 32 rows): where N / 32 CTAs fit one wave and K has at most
// kNarrowShortKAtoms atoms, the wide planner cannot give a CTA fewer bytes to stream unless N is below 256:
// its CTAs own at least 4 warps x 64 rows and split K at most kMaxShortSplits ways, 256 x K / 8 = 32 x K. So a
// narrow32 CTA streams what a wide one does, without the split-K partials' round trips, on at least as many
// SMs (PlanW4a16Launch takes it when its bytes per CTA are at most the wide plan's). Session 26
// (benchmarks/NOTES.md), us at M = 1 / 4 / 16, wide or narrow -> narrow32: 4096² 7.6 / 7.7 / 9.5 -> 6.9 / 7.1 / 8.9,
// 4096 x 8192 11.4 / 11.4 / 14.4 -> 10.2 / 10.5 / 13.8, 3072² 6.5 / 6.6 / 8.3 -> 5.7 / 5.9 / 6.9, 1024 x 4096
// 7.1 / 7.2 / 9.2 -> 6.3 / 6.4 / 7.0, 1024² (narrow) 4.0 / 4.1 / 4.7 -> 3.7 / 3.8 / 4.1; against the wide plan's
// 14 splits of 16 atoms it lost (4096 x 14336: 15.0 / 15.0 / 19.8 -> 16.0 / 16.2 / 19.5).

struct W4a16Plan {
  int m_tiles;          // n8 tiles of tokens
  int block_m;          // tokens per CTA
  W4a16Form form;
  int ctas_per_sm;
  int max_warps;        // warps a CTA may launch (the kernel's launch bound)
  int stage_atoms;      // 64-wide K atoms per stage: 1, narrow and narrow32 kNarrowStageAtoms
  int tiles_per_warp;   // m16 tiles of W per warp
  int block_rows;       // rows of W per CTA at most (all its row warps, narrow: one; the launcher may pick fewer)
  int stages;
  int stage_weight_bytes;
  int stage_x_bytes;
  int stage_scale_bytes;  // scales and zero points of stage_atoms x kMaxGroupsPerAtom groups of block_rows rows
  int stage_bytes;
  int ring_bytes;
  int barrier_bytes;    // a full and an empty mbarrier per stage
  int cluster_sum_bytes;  // narrow: kMaxNarrowCluster - 1 slots of a warp's accumulators, and their mbarrier
  int lane_sum_bytes;   // narrow: k-lanes 1.. put their accumulators here for k-lane 0's sum; inside the ring
  int total_bytes;      // dynamic shared memory per CTA
  int per_sm_bytes;     // ctas_per_sm x (total + the driver's reservation)

  constexpr bool fits() const {
    return stages >= kMinStages && total_bytes <= budget::kSmemPerBlockSm90 && per_sm_bytes <= budget::kSmemPerSmSm90 &&
           lane_sum_bytes <= ring_bytes;
  }
};

// The deepest ring (up to kMaxStages, narrow: kMaxNarrowStages) that lets the plan's CTAs share the SM.
constexpr W4a16Plan SolveW4a16Plan(int m_tiles, W4a16Form form = W4a16Form::kWide) {
  W4a16Plan p{};
  const bool narrow = IsNarrow(form);
  const int row_warps = narrow ? 1 : IsWhole(form) ? WholeMaxWarps(m_tiles) : kMaxWarps;
  p.m_tiles = m_tiles;
  p.block_m = 8 * m_tiles;
  p.form = form;
  p.ctas_per_sm = form == W4a16Form::kWide ? CtasPerSm(m_tiles) : 1;
  p.max_warps = narrow ? NarrowMaxLanes(m_tiles, form) + 1 : row_warps;
  p.stage_atoms = narrow ? kNarrowStageAtoms : 1;
  p.tiles_per_warp = TilesPerWarp(m_tiles, form);
  p.block_rows = row_warps * WarpRows(m_tiles, form);
  p.stage_weight_bytes = p.stage_atoms * row_warps * p.tiles_per_warp * kAtomBytes;
  p.stage_x_bytes = p.stage_atoms * p.block_m * kXRowBytes;
  p.stage_scale_bytes = p.stage_atoms * kMaxGroupsPerAtom * p.block_rows * (kScaleBytes + kZeroBytes);
  p.stage_bytes = p.stage_weight_bytes + p.stage_x_bytes + p.stage_scale_bytes;
  const int per_cta = static_cast<int>(budget::kSmemPerSmSm90 / p.ctas_per_sm - budget::kSmemReservedPerCtaSm90);
  const int cluster_slot_bytes = (kMaxNarrowCluster - 1) * WarpAccumulatorBytes(m_tiles, form);
  p.cluster_sum_bytes = narrow ? cluster_slot_bytes + static_cast<int>(2 * budget::kMbarrierBytes) : 0;
  p.lane_sum_bytes = narrow ? (p.max_warps - 2) * WarpAccumulatorBytes(m_tiles, form) : 0;  // less the producer, lane 0
  const int fixed = static_cast<int>(budget::kSwizzledAlign) + p.cluster_sum_bytes;
  const int stage_barrier_bytes = static_cast<int>(2 * budget::kMbarrierBytes);
  const int fit = (per_cta - fixed) / (p.stage_bytes + stage_barrier_bytes);
  const int max_stages = narrow ? kMaxNarrowStages : kMaxStages;
  p.stages = fit < max_stages ? fit : max_stages;
  p.ring_bytes = p.stages * p.stage_bytes;
  p.barrier_bytes = p.stages * stage_barrier_bytes;
  p.total_bytes = p.ring_bytes + p.barrier_bytes + fixed;
  p.per_sm_bytes = p.ctas_per_sm * (p.total_bytes + budget::kSmemReservedPerCtaSm90);
  return p;
}

// ------------------------------------------------------------------------------------ launch plan

inline constexpr int kMaxTokensPerBlock = 64;             // tokens per CTA at most; more run along grid y
inline constexpr int64_t kMaxK = int64_t{1} << 24;       // keeps in-kernel offsets in 32 bits
inline constexpr int kMaxGridY = 65535;
inline constexpr int kSaturatingWarpsPerSm = 12;         // the planner's model: fewer warps per SM stream slower
// A split CTA streams at least this many 64-wide atoms: the model above has no term for the split-K tail,
// and 4096 x 4096 at M <= 8 took 33 splits of 2 atoms in 12.6-15.5 us, 16 splits of 4 in 8.9 (session 8).
inline constexpr int kMinAtomsPerSplit = 4;
// At 64 tokens a split CTA's partials (64 KB for 256 rows) rival its weights, and one CTA sums them:
// 4096 x 4096 at M = 64 took 16.5-16.7 us in 8 splits, 15.2 in 4 (session 10); fewer splits lost at 32 tokens.
inline constexpr int kMaxSplitsAt64Tokens = 4;
// Up to 16 tokens (the mma.sync tiles, 512-row CTAs) more than 8 splits pay only when each streams at least
// 16 atoms: a tile's last CTA waits for all its splits, and short splits leave the SMs idle between their
// ramp and the tile's reduction. Session 12, 16 tokens: 16 x 8192² took 24.8 us in 16 splits of 8 atoms,
// 20.1 in 8; 16 x 8192 x 28672 48.7 in 16 splits of 28 atoms, 53.6 in 8; 16 x 4096² 11.6 in 16 splits of 4
// atoms, 10.5 in 8. Session 13, up to 8 tokens: 1 x 8192² 16.2-16.4 -> 14.7-14.8 us, 8 x 8192² 17.6-17.9 ->
// 15.2-15.4 (4-warp CTAs in 8 splits of 16 atoms; in 16 splits of 8, ncu: SMs active 68% of the kernel).
inline constexpr int kMaxShortSplits = 8;
inline constexpr int kMinAtomsPerManySplits = 16;
// The split-K reduction in the planner's model (mma.sync tiles): a tile's last CTA reads every split's
// partials (a 2 KB fragment per warp, split and n8 token tile: the weight bytes of one warp's atom), and
// each split and warp costs kReductionPercent of a streamed warp-atom, at 8 and at 16 tokens alike: the
// loads come in rounds, one round trip per split. Fit on the H200 (session 18, benchmarks/NOTES.md), 16
// tokens: 40 took 16 x 4096 x 28672 34.5 -> 29.2 us (4 warps x 16 tiles x 16 splits, not 6 x 11 x 24), 80
// 16 x 8192 x 14336 32.0 -> 28.1 and 16 x 14336 x 2048 14.1 -> 11.7, 120 won on two shapes of twelve and lost on
// two, among them 16 x 8192 x 28672 (46.8 -> 50.0 in 8 splits of 4-warp CTAs); up to 8 tokens 40 beat none (1 x
// 4096 x 28672 25.2 -> 22.8), 80 beat 40 on nine shapes of ten (1 x 16384 x 3072 12.8-13.0 -> 11.7) and 60 on
// three of them (1 x 11008² 24.3 -> 22.8-22.9).
inline constexpr int64_t kReductionPercent = 80;
// Whole-SM CTAs (HasForm). At one token tile the two wide CTAs on an SM stream unevenly (session 15: 22.8
// and 30.1 us for the same bytes at 1 x 28672 x 8192), and a tile waits for its slowest split; one CTA with the pair's
// warps on one ring does not. Session 25 (benchmarks/NOTES.md), a probe with whole-SM CTAs for every mma.sync
// plan (us at M = 1 / 4 / 16, wide -> whole): 28672 x 8192 37.2-37.5 / 37.6 / 46.8 -> 36.3 / 36.4 / 46.6,
// 16384 x 12288 32.0-32.1 / 32.1-32.2 / 39.0 -> 30.4-30.5 / 30.6-30.7 / 39.1-39.2; with short splits it lost:
// 14336 x 4096 (8 splits of 8 atoms) 13.8-13.9 -> 14.0-14.2 at M = 1, 18.4 -> 19.4 at 16; 4 x 8192² (6 splits
// of 21 atoms) 14.5-14.6 -> 17.5. So: one token tile, splits of at least kWholeMinAtomsPerSplit atoms, and no
// more than 1 / kWholeIdleSmsDivisor of the SMs without a CTA. With this rule (M = 1 / 4 / 8): 28672 x 8192
// 37.3 / 37.5 / 38.0 -> 36.0 / 36.1 / 37.0, 16384 x 12288 31.7 / 31.7 / 32.2 -> 30.4 / 30.7 / 31.3, 11008 x 28672
// 46.1 / 46.1 / 46.5 -> 45.2 / 45.4 / 46.9, 8 x 8192 x 28672 37.4 -> 35.7.
// The 32-token tile (session 29): wgmma with 4 m16 tiles a warp in every plan (one CTA per SM, as its wide plan),
// us at M = 24 / 32: 28672 x 8192 74.1 / 74.3 -> 60.7 / 61.3, 8192 x 28672 67.6 / 68.0 -> 56.7 / 57.4; with short
// splits it lost: 8192² (16 atoms) 22.3 / 22.8 -> 22.6 / 23.3, 11008 x 4096 16.7 / 17.0 -> 18.3 / 18.9, 4096 x 14336
// 20.8 / 21.1 -> 24.9 / 25.5, 4096² 10.6 / 10.8 -> 17.7 / 18.3. The same rule separates them, with at most
// kWholeMaxSplits splits (4096 x 28672 in 13 splits of 35 atoms: 36.9-37.1 -> 40.8-41.2 us at 32 tokens) and
// WholeMinWarps. Kept rule, us at M = 17 / 32: 28672 x 8192 73.8 / 74.5 -> 60.1 / 61.3, 8192 x 28672 67.3 / 68.1 ->
// 56.1 / 57.5, 16384 x 12288 58.0 / 58.6 -> 47.9 / 49.3, 11008 x 28672 88.7 / 89.7 -> 71.5-71.9 / 73.1, 14336 x 8192
// 39.4 / 39.9 -> 33.9 / 35.0, 28672 x 4096 37.7 / 38.1 -> 33.2 / 34.2, 8192 x 16384 40.1 / 40.7 -> 35.9 / 37.1.
// The 16-token tile (session 30): mma.sync with 8 m16 tiles a warp under the same rule, us at M = 9 / 16: 28672 x
// 8192 45.2-45.5 / 46.2-46.5 -> 42.9-43.0 / 44.2; past 8 splits it lost (8192 x 28672 in 13 of 35 atoms: 46.6 ->
// 50.1-50.2 at 16 tokens; 11008 x 28672 in 12 of 38 gained 57.8 -> 56.0).
inline constexpr int64_t kWholeMinAtomsPerSplit = 32;
inline constexpr int kWholeIdleSmsDivisor = 16;
inline constexpr int64_t kWholeMaxSplits = 8;  // past one token tile

// One-CTA-per-SM wide and whole-SM CTAs launch a warpgroup past their computing ones whose first warp only produces
// (w4a16_gemm.cu, Pipelines); the others keep the producer lane in their last computing warp: two-CTA-per-SM wide
// CTAs, whose computing warps a producer warpgroup would leave fewer registers than they use, and kWhole at the
// 16-token tile, whose fp16 instance needs 254 registers a thread, more than the 232 that setmaxnreg gives.
inline constexpr int kProducerWarpgroupThreads = 128;
constexpr bool HasProducerWarpgroup(int m_tiles, W4a16Form form) {
  if (IsNarrow(form)) return false;
  if (form == W4a16Form::kWide) return CtasPerSm(m_tiles) == 1;
  return !(form == W4a16Form::kWhole && m_tiles == 2);
}

// Since the producer warpgroup (session 51), whole7 CTAs at the 16-token tile beat a wide pair from 16 atoms a
// split (session 52, us at 9 / 16 tokens, wide -> whole7: 57344 x 3584 (2 splits of 28 atoms) 39.4-39.5 / 40.3-40.4
// -> 34.2-34.3 / 35.9-36.1, 14336 x 14336 (8 of 28) 38.8-39.0 / 39.8 -> 35.7-36.0 / 37.0, 27648 x 5120 (4 of 20)
// 30.1-30.2 / 30.9-31.1 -> 27.4 / 28.4-28.6, 28672 x 4096 (4 of 16) 25.1-25.2 / 25.8-25.9 -> 24.1 / 25.0-25.1,
// 14336 x 8192 (8 of 16) 26.2 / 26.6-26.9 -> 25.9-26.0 / 26.7-26.9; with 8-11 atoms they lost 1.6-7.5%: 14336 x 4096,
// 18944 x 3584, 22016 x 4096). Not so kWhole, which keeps its producer lane at that tile (16384 x 8192 in 8 splits of
// 16 atoms: 28.3-28.5 -> 29.6 us at 16 tokens), nor the one-token tile (16 atoms: 28672 x 4096, 14336 x 8192,
// 12288 x 12288 lost 1.5-3.5% at 1 and 8 tokens). (No narrow plan competes with these: at 9-16 tokens a narrow
// launch has at most num_sms x 64 rows, a whole-SM one, in at most kWholeMaxSplits splits on 15/16 of the SMs, more
// than num_sms x 100.)
inline constexpr int64_t kWholeProducerMinAtomsPerSplit = 16;
constexpr int64_t WholeMinAtomsPerSplit(int m_tiles, W4a16Form form) {
  const bool producer_warpgroup_at_16_tokens = m_tiles == 2 && HasProducerWarpgroup(m_tiles, form);
  return producer_warpgroup_at_16_tokens ? kWholeProducerMinAtomsPerSplit : kWholeMinAtomsPerSplit;
}

struct W4a16Problem {
  int64_t m, n, k, group_size;  // group_size == k: per channel
  bool act_order;               // g_idx given: X's columns are gathered into the workspace first
};

struct W4a16Launch {
  int m_tiles;   // n8 token tiles per CTA: 1, 2, 4 or 8
  int m_blocks;  // CTAs along the tokens
  int warps;     // warps that own rows of W, kMinWarps..kMaxWarps (whole: ..WholeMaxWarps; W4a16Threads launches
                 // whole warpgroups); narrow: 1
  int n_tiles;
  int splits;    // split-K factor; narrow: the CTAs of a K-split cluster (1: no cluster)
  W4a16Form form;  // the CTAs' plan: SolveW4a16Plan(m_tiles, form); narrow: k_lanes warps share one warp's rows
  int k_lanes;   // 1, or a narrow CTA's computing warps
  int lane_atoms;  // narrow: the atoms of a k-lane's runs (kNarrowShortRunAtoms or a stage); wide: 1
  int k_phases;    // narrow: the stages its CTAs start K at, evenly spaced (NarrowKPhases); 1: all at the first
};

struct W4a16Workspace {
  int64_t partials, x_perm, total;  // byte offsets and total size
};

// What the kernel serves (w4a16_layout.check_shape on the Python side): N % 32, K % 64, group size
// 32/64/128/K, and the limits of its 32-bit offsets and grid.
constexpr bool W4a16ShapeSupported(const W4a16Problem& p) {
  const bool group_ok = p.group_size == 32 || p.group_size == 64 || p.group_size == 128 || p.group_size == p.k;
  return p.m >= 1 && p.n >= kRowGranule && p.k >= kAtomCols && p.n % kRowGranule == 0 && p.k % kAtomCols == 0 &&
         group_ok && p.k % p.group_size == 0 && p.m <= int64_t{kMaxGridY} * kMaxTokensPerBlock &&
         p.n * p.m < (int64_t{1} << 40) && p.n <= (int64_t{1} << 30) && p.k <= kMaxK;
}

constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Threads of a CTA with `warps` row-owning warps: whole warpgroups, since wgmma is issued by all four
// warps of one. The extra warps own no rows: they run the loop on stale shared memory and store nothing
// (skipping their work behind a branch, and launching only the row-owning warps for mma.sync, measured
// slower in session 10; skipping the loop changed every wide mma.sync kernel's schedule and lost on most
// shapes in session 18: benchmarks/NOTES.md). So the planner counts them (PlanW4a16Launch).
constexpr int W4a16Threads(int warps) { return static_cast<int>(CeilDiv(warps, 4)) * 128; }

// Narrow (64 rows) or wide: a narrow CTA streams its rows' weights and pays no split-K round trips (the
// partials' stores, release, arrival and the last CTA's loads). The model (us), fit to session 27's
// measurements (benchmarks/NOTES.md): both forms stream kStreamBytesPerUsPerSm into an SM, so the wide plan's
// time follows its busiest SM; a narrow launch costs kNarrowSavingUs less than an unsplit wide one, and every
// split of the wide plan kSplitUsPerSplit more. Measured wide -> narrow forced, us at M = 1 / 4 / 8 / 16:
// 6144 x 4096 8.9 / 9.1 / 9.6 / 12.0 -> 8.1 / 8.3 / 8.6 / 11.5, 5120 x 8192 14.0 / 14.0 / 14.5 / 18.4 -> 12.5 / 12.6 /
// 12.6 / 18.0, 7168 x 8192 14.2 / 14.3 / 14.7 / 18.5 -> 13.0 / 13.3 / 14.0 / 18.8, 8192 x 2048 6.9 / 7.0 / 7.4 / 9.4
// -> 6.4 / 6.7 / 7.0 / 7.9 (same bytes on the busiest SM, 8 splits); where a narrow CTA streams 1.33-1.56x the
// busiest wide SM's bytes it lost (6144 x 12288 16.3 -> 17.3, 5120 x 14336 16.2 -> 19.3 at M = 1).
// With two token tiles and 6 k-lanes (half a 12-stage ring) the narrow CTA lost from K = 6144 up at 16 tokens
// (8192 x 6144 15.3 -> 16.1, 8192² 18.7 -> 19.5, 8192 x 12288 24.7 -> 26.9; session 27); with 12 lanes in runs of one
// atom it wins up to K = 8192 (session 38, us at M = 16, wide -> narrow: 8192² 18.2 -> 17.3, 5120 x 8192 17.8 ->
// 14.8), and with its CTAs in K phases at any K (session 40, us at M = 9 / 16, wide -> narrow: 8192 x 11008 22.5 /
// 22.9 -> 18.9 / 19.3, 8192 x 14336 27.2 / 27.6 -> 23.5 / 23.8, 8448 x 16384 30.4 / 30.8 -> 26.3 / 26.8, 8192 x
// 28672 45.0 / 45.8 -> 42.9 / 43.5; 7168 x 12288, 112 CTAs unphased, 22.7 / 23.1 -> 21.0 / 21.7). K-split clusters:
// the wide plans split K 10-28 ways, and at 9 and 16 tokens clusters of 2 and 4 won everywhere measured (session 28,
// us at M = 16, wide -> cluster: 4096 x 14336 19.7 -> 17.7, 3072 x 14336 19.5 -> 17.1, 4096 x 11008 19.7 -> 15.0,
// 1536 x 28672 22.5 -> 17.2, 1024 x 28672 17.7 -> 17.0), also with more than 128 atoms a CTA (session 40, us at M =
// 9 / 16: 3584 x 18944 20.8 / 21.3 -> 17.1 / 17.4, 4096 x 28672 28.6 / 28.9 -> 24.0 / 24.8, 3072 x 24576 22.3 / 22.8 ->
// 20.7 / 20.9, 2048 x 18432 19.3 / 19.8 -> 16.2 / 16.3). So two token tiles have no K limit either way.
// Against whole-SM plans (long K) narrow CTAs won at up to 4 tokens and lost at 8 (8 x 8192 x 28672: whole 35.7,
// narrow 36.9; session 25), hence kNarrowOverWholeMaxTokens.
// Checked on layers outside the fit (4608 x 3072, 6144 x 1536, 8192 x 512, 5120 x 2048, 7168 x 12288, 8448 x
// 4096): 0.1-2.1 us faster, no cell slower. Cells it gets wrong: 8192² at 8 tokens (15.0 -> 15.6), 8192 x 4096
// at 16 (12.0 -> 12.2); 4608 x 8192 and 5120 x 8192 at 16 (narrow 0.3 us faster, not taken).
inline constexpr double kStreamBytesPerUsPerSm = 28.5e3;
inline constexpr double kNarrowSavingUs = 0.3;
inline constexpr double kSplitUsPerSplit = 0.15;
inline constexpr int kNarrowOverWholeMaxTokens = 4;

// Modeled us a narrow launch saves against the wide plan, from the weight rows x atoms of a narrow CTA and
// of the wide plan's busiest SM.
constexpr double NarrowGainUs(int64_t narrow_row_atoms, int64_t wide_sm_row_atoms, int wide_splits) {
  const double extra_bytes = static_cast<double>(narrow_row_atoms - wide_sm_row_atoms) * kAtomCols / 2;
  return kNarrowSavingUs + kSplitUsPerSplit * wide_splits - extra_bytes / kStreamBytesPerUsPerSm;
}

// A narrow CTA's k-lanes: as many as its plan launches (max_warps less the producer), as leave two of the ring's runs
// to every lane (runs of lane_atoms: with one-atom runs four lanes share a stage), and no more than K's stages (with
// short runs too: a lane per run cost 1024² at 16 tokens 4.7 -> 5.0 us, session 17).
constexpr int NarrowKLanes(const W4a16Plan& cta, int64_t atoms, int lane_atoms) {
  const int64_t lanes = std::min<int64_t>(
      {cta.max_warps - 1, cta.stages / 2 * (kNarrowStageAtoms / lane_atoms), CeilDiv(atoms, kNarrowStageAtoms)});
  return static_cast<int>(std::max<int64_t>(1, lanes));
}

// The K order of an unsplit narrow launch: with k_phases > 1, the CTA of row tile t starts its K loop at stage
// (t % k_phases) x stages / k_phases and wraps around, so that its CTAs do not all read the same X stage from L2 at
// once (every narrow CTA reads all of X: at 8-16 tokens half to all of a stage's weight bytes; 16 x 8192² took 17.4
// us, 9 x 8192² 16.3: the same kernel, 7 token rows fewer). Session 39 (benchmarks/NOTES.md), every narrow launch in
// 8 phases, us at M = 1 / 8 / 16: 8192² 12.8 / 14.9 / 17.4 -> 12.6 / 13.3 / 15.3, 4096² (narrow32) 6.42 / 7.17 / 8.43
// -> 6.57 / 6.60 / 7.57, 8192 x 4096 8.08 / 8.95 / 10.80 -> 8.07 / 8.40 / 10.04; with fewer CTAs it lost, 5120 x 8192
// (80) 11.52 / 11.73 / 14.75 -> 11.95 / 12.04 / 14.68, and with K-split clusters, whose ranks read different X
// already, 1536 x 28672 11.13 / 11.25 / 13.80 -> 11.56 / 11.65 / 14.08 (that build rotated the k-lanes' atom indices
// too, which alone cost unphased launches 1-5%: part of these losses); 2 and 4 phases gained less at 8-16 tokens, a
// start of its own for every CTA lost more at 1. Hence: 8 phases from kNarrowPhasedMinTokens tokens, unsplit, CTAs on
// all but 1 / kNarrowPhasedIdleSmsDivisor of the SMs, and K in whole stages (a rotation by whole stages keeps every
// group and promotion boundary where it was).
inline constexpr int kNarrowKPhases = 8;
static_assert((kNarrowKPhases & (kNarrowKPhases - 1)) == 0, "the kernel takes a CTA's phase as a mask of its tile");
inline constexpr int64_t kNarrowPhasedMinTokens = 8;
inline constexpr int kNarrowPhasedIdleSmsDivisor = 8;
constexpr int NarrowKPhases(const W4a16Launch& l, int64_t tokens, int64_t atoms, int num_sms) {
  const int64_t ctas = int64_t{l.n_tiles} * l.m_blocks;
  const bool phased = tokens >= kNarrowPhasedMinTokens && l.splits == 1 &&
                      ctas >= num_sms - num_sms / kNarrowPhasedIdleSmsDivisor && atoms % kNarrowStageAtoms == 0 &&
                      atoms / kNarrowStageAtoms >= kNarrowKPhases;
  return phased ? kNarrowKPhases : 1;
}

// Splits of K come in whole granules of atoms: wide split-K any atom; narrow clusters the widest fixed group
// (128 columns), so that a 4-atom stage starts on a 128-wide group and holds at most two, as many as its scale
// box loads.
inline constexpr int kNarrowSplitGranuleAtoms = kWidestFixedGroup / kAtomCols;
static_assert(kNarrowStageAtoms % kNarrowSplitGranuleAtoms == 0);
constexpr int64_t SplitGranule(W4a16Form form) { return IsNarrow(form) ? kNarrowSplitGranuleAtoms : 1; }

// The first atom of split `split` of `splits` over `atoms` atoms of a `form` launch, as even as whole granules
// come; split `splits` gives `atoms`.
constexpr int SplitAtomBegin(int64_t split, int64_t splits, int64_t atoms, W4a16Form form) {
  const int64_t granule = SplitGranule(form);
  return static_cast<int>(std::min(atoms, split * CeilDiv(atoms, granule) / splits * granule));
}
// At least the atoms of the longest split of `plan` over `atoms` atoms.
constexpr int64_t MaxSplitAtoms(const W4a16Launch& plan, int64_t atoms) {
  const int64_t granule = SplitGranule(plan.form);
  return std::min(atoms, CeilDiv(CeilDiv(atoms, granule), plan.splits) * granule);
}

// CTAs of clusters of `cluster` (2 or 4) one-CTA-per-SM CTAs that are resident at once. A cluster runs inside
// one GPC: on the H200 cudaOccupancyMaxActiveClusters gives 66 clusters of 2 and 30 of 4 (session 28); other SM
// counts are scaled from it (a wrong count only costs a second wave, never a result).
inline constexpr int kH200Sms = 132;
inline constexpr int kH200ClusterOf4Ctas = 120;
static_assert(kMaxNarrowCluster == 4, "NarrowClusterSlots knows clusters of 2 and 4");
constexpr int64_t NarrowClusterSlots(int cluster, int num_sms) {
  const int64_t sms = cluster == 2 ? num_sms : int64_t{num_sms} * kH200ClusterOf4Ctas / kH200Sms;
  return sms / cluster * cluster;
}

// The K-split cluster of a narrow launch of `ctas` row tiles over `atoms` atoms: the largest of
// kMaxNarrowCluster, ..., 2 whose clusters fit one wave and leave each CTA kNarrowClusterMinAtoms; else 1.
constexpr int NarrowClusterSize(int64_t ctas, int64_t atoms, int num_sms) {
  for (int cluster = kMaxNarrowCluster; cluster > 1; cluster /= 2) {
    if (ctas * cluster <= NarrowClusterSlots(cluster, num_sms) && atoms >= cluster * kNarrowClusterMinAtoms) {
      return cluster;
    }
  }
  return 1;
}

// One wave over the SMs, as little work per SM as possible: the time of a memory-bound wave is the
// largest CTA's bytes over its share of the SM's bandwidth, and an SM with fewer than
// kSaturatingWarpsPerSm warps gets a proportionally smaller share (it cannot hide the latency). Up to 16
// tokens a CTA's bytes count its launched warps, and a split adds its reduction (kReductionPercent). Ties
// go to more CTAs, then to more warps and fewer splits (less reduction traffic).
constexpr W4a16Launch PlanW4a16Launch(const W4a16Problem& p, int num_sms) {
  W4a16Launch plan{};
  plan.m_tiles = p.m <= 8 ? 1 : p.m <= 16 ? 2 : p.m <= 32 ? 4 : 8;
  plan.m_blocks = static_cast<int>(CeilDiv(p.m, 8 * plan.m_tiles));
  const int64_t atoms = p.k / kAtomCols;
  const int64_t slots = int64_t{num_sms} * CtasPerSm(plan.m_tiles);
  int64_t max_splits = std::max<int64_t>(1, atoms / kMinAtomsPerSplit);
  if (8 * plan.m_tiles == kMaxTokensPerBlock) max_splits = std::min<int64_t>(max_splits, kMaxSplitsAt64Tokens);
  const bool mma_sync = plan.m_tiles <= kMaxMmaSyncMTiles;
  if (mma_sync) {
    max_splits = std::min<int64_t>(max_splits, std::max<int64_t>(kMaxShortSplits, atoms / kMinAtomsPerManySplits));
  }
  // The column tiles of CTAs with `warps` row warps of `form`, with the token blocks, and the splits that fill
  // `slots` CTAs.
  struct Grid {
    int64_t n_tiles, tiles, splits;
  };
  const auto grid = [&](int warps, int64_t slots, W4a16Form form) {
    const int64_t n_tiles = CeilDiv(p.n, int64_t{warps} * WarpRows(plan.m_tiles, form));
    const int64_t tiles = n_tiles * plan.m_blocks;
    return Grid{n_tiles, tiles, std::clamp<int64_t>(slots / tiles, 1, max_splits)};
  };
  int64_t best_cost = INT64_MAX;
  int64_t best_ctas = 0;
  for (int warps = kMaxWarps; warps >= kMinWarps; --warps) {
    const auto [n_tiles, tiles, splits] = grid(warps, slots, W4a16Form::kWide);
    const int64_t waves = CeilDiv(tiles * splits, slots);
    const int64_t warps_per_sm = int64_t{warps} * CtasPerSm(plan.m_tiles);
    // mma.sync tiles: the launched warps without rows run the loop as row warps do, so they count (session
    // 18: 6144 x 12288 at 1 token took 21.1 us in 5-warp CTAs, launched as 8, and 16.3 in 4-warp ones), and
    // so does the split-K reduction (kReductionPercent). Per cent of a streamed warp-atom.
    const int64_t launched = mma_sync ? W4a16Threads(warps) / 32 : warps;
    const int64_t reduction = mma_sync && splits > 1 ? splits * warps * kReductionPercent : 0;
    const int64_t cost = 100 * waves * launched * CeilDiv(atoms, splits) * kSaturatingWarpsPerSm /
                             std::min<int64_t>(warps_per_sm, kSaturatingWarpsPerSm) +
                         reduction;
    // More CTAs at the same modeled cost: with many tokens the CTAs are compute-bound and their time
    // follows their rows (28672 x 8192 at 64 tokens: 128 CTAs of 7 warps, not 112 of 8).
    const int64_t ctas = tiles * splits;
    if (cost < best_cost || (cost == best_cost && ctas > best_ctas)) {
      best_cost = cost;
      best_ctas = ctas;
      plan.warps = warps;
      plan.n_tiles = static_cast<int>(n_tiles);
      plan.splits = static_cast<int>(splits);
    }
  }
  plan.k_lanes = 1;
  plan.lane_atoms = 1;
  plan.k_phases = 1;
  // Whole-SM CTAs (HasForm, WholeMinAtomsPerSplit, kWholeMaxSplits): of the token tile's whole forms and
  // WholeMinWarps..WholeMaxWarps row warps, the most CTAs up to one per SM (one wave: a second wave of a few CTAs
  // would cost as long as the first); ties go to more row warps (a launched warp without rows runs a row warp's
  // MMAs), then to the least MMA work on an SM's busiest scheduler (its launched warps x their m16 tiles x the
  // split's atoms).
  W4a16Launch whole = plan;
  int64_t whole_ctas = 0;
  int64_t whole_work = 0;
  for (const W4a16Form form : kWholeForms) {
    if (!HasForm(plan.m_tiles, form)) continue;
    for (int warps = WholeMaxWarps(plan.m_tiles); warps >= WholeMinWarps(plan.m_tiles); --warps) {
      const auto [n_tiles, tiles, splits] = grid(warps, num_sms, form);
      const int64_t ctas = tiles * splits;
      const int64_t work =
          CeilDiv(W4a16Threads(warps) / 32, kSchedulersPerSm) * TilesPerWarp(plan.m_tiles, form) * CeilDiv(atoms, splits);
      const bool better = ctas > whole_ctas ||
                          (ctas == whole_ctas && (warps > whole.warps || (warps == whole.warps && work < whole_work)));
      if (ctas <= num_sms && better) {
        whole_ctas = ctas;
        whole_work = work;
        whole.form = form;
        whole.warps = warps;
        whole.n_tiles = static_cast<int>(n_tiles);
        whole.splits = static_cast<int>(splits);
      }
    }
  }
  const bool whole_fits = whole_ctas >= num_sms - num_sms / kWholeIdleSmsDivisor &&
                          CeilDiv(atoms, whole.splits) >= WholeMinAtomsPerSplit(plan.m_tiles, whole.form) &&
                          (plan.m_tiles == 1 || whole.splits <= kWholeMaxSplits);
  if (mma_sync) {
    // A narrow launch of `form`: one row tile per cluster of `splits` CTAs (NarrowClusterSize), each CTA
    // with 1 / splits of K, k-lanes in runs of lane_atoms.
    const auto narrow = [&](W4a16Form form) {
      W4a16Launch l = plan;
      l.form = form;
      l.warps = 1;
      l.n_tiles = static_cast<int>(CeilDiv(p.n, WarpRows(plan.m_tiles, form)));
      l.splits = NarrowClusterSize(int64_t{l.n_tiles} * plan.m_blocks, atoms, num_sms);
      const int64_t cta_atoms = MaxSplitAtoms(l, atoms);
      l.lane_atoms = NarrowLaneAtoms(plan.m_tiles, form, cta_atoms);
      l.k_lanes = NarrowKLanes(SolveW4a16Plan(plan.m_tiles, form), cta_atoms, l.lane_atoms);
      l.k_phases = NarrowKPhases(l, p.m, atoms, num_sms);
      return l;
    };
    // Narrow32 (kNarrow32TilesPerWarp): one wave, short K a CTA, and no more rows x columns per CTA than the
    // wide plan's.
    const W4a16Launch narrow32 = narrow(W4a16Form::kNarrow32);
    const int64_t narrow32_atoms = MaxSplitAtoms(narrow32, atoms);
    const int64_t wide_cta_rows = std::min<int64_t>(p.n, int64_t{plan.warps} * WarpRows(plan.m_tiles));
    if (int64_t{narrow32.n_tiles} * plan.m_blocks <= num_sms && narrow32_atoms <= kNarrowShortKAtoms &&
        WarpRows(plan.m_tiles, W4a16Form::kNarrow32) * narrow32_atoms <=
            wide_cta_rows * CeilDiv(atoms, plan.splits)) {
      return narrow32;
    }
    // Narrow (64 rows): one wave, and faster than the wide plan in NarrowGainUs's model.
    const W4a16Launch narrow64 = narrow(W4a16Form::kNarrow);
    const int64_t narrow64_atoms = MaxSplitAtoms(narrow64, atoms);
    if (int64_t{narrow64.n_tiles} * plan.m_blocks <= num_sms &&
        (!whole_fits || p.m <= kNarrowOverWholeMaxTokens) &&
        NarrowGainUs(WarpRows(plan.m_tiles) * narrow64_atoms,
                     CeilDiv(int64_t{plan.n_tiles} * plan.m_blocks * plan.splits, num_sms) * wide_cta_rows *
                         CeilDiv(atoms, plan.splits),
                     plan.splits) > 0) {
      return narrow64;
    }
  }
  return whole_fits ? whole : plan;
}

// Threads of a launch: whole warpgroups of its row warps (and the producer warpgroup); narrow, its k-lanes and the
// producer warp.
constexpr int W4a16LaunchThreads(const W4a16Launch& plan) {
  if (IsNarrow(plan.form)) return (plan.k_lanes + 1) * 32;
  return W4a16Threads(plan.warps) + (HasProducerWarpgroup(plan.m_tiles, plan.form) ? kProducerWarpgroupThreads : 0);
}

// Split-K arrival counters (common/arrival_counters.h, not workspace): one per token block, column tile and row warp
// of the form (its plan's max_warps), since the last of a row warp's splits to arrive sums that warp's rows; none
// for unsplit and narrow launches. The kernel's counter of (m_block, tile, row_warp) is
// (m_block x n_tiles + tile) x W4a16CounterWarps + row_warp.
constexpr int W4a16CounterWarps(int m_tiles, W4a16Form form) { return SolveW4a16Plan(m_tiles, form).max_warps; }
constexpr int64_t W4a16ArrivalCounters(const W4a16Launch& plan) {
  if (plan.splits == 1 || IsNarrow(plan.form)) return 0;
  return int64_t{plan.m_blocks} * plan.n_tiles * W4a16CounterWarps(plan.m_tiles, plan.form);
}

// Split-K fragment-order partials, then the act-order gather of X (bf16/fp16).
constexpr W4a16Workspace LayOutW4a16Workspace(const W4a16Problem& p, const W4a16Launch& plan) {
  const auto align = [](int64_t bytes) { return budget::AlignUp(bytes, budget::kWorkspaceAlign); };
  W4a16Workspace ws{};
  int64_t offset = 0;
  if (plan.splits > 1 && !IsNarrow(plan.form)) {  // narrow clusters add through shared memory
    ws.partials = offset;
    offset += align(int64_t{plan.m_blocks} * plan.n_tiles * plan.splits * plan.warps *
                    WarpAccumulatorBytes(plan.m_tiles, plan.form));
  }
  if (p.act_order) {
    ws.x_perm = offset;
    offset += align(2 * p.m * p.k);
  }
  ws.total = offset;
  return ws;
}

// A split (splits >= 2) needs tiles <= slots / 2 (splits = slots / tiles; whole-SM: slots = num_sms), so the
// arrival counters, W4a16CounterWarps per tile, fit the pool for every num_sms the handlers accept.
constexpr bool W4a16CountersFitPool() {
  const auto fits = [](int m_tiles, W4a16Form form) {
    const int64_t max_tiles = int64_t{kMaxNumSms} * SolveW4a16Plan(m_tiles, form).ctas_per_sm / 2;
    return !HasForm(m_tiles, form) || max_tiles * W4a16CounterWarps(m_tiles, form) <= kArrivalCounters;
  };
  for (int m_tiles : kMTileOptions) {
    if (!fits(m_tiles, W4a16Form::kWide)) return false;
    for (W4a16Form form : kWholeForms) {
      if (!fits(m_tiles, form)) return false;
    }
  }
  return true;
}
static_assert(W4a16CountersFitPool(), "w4a16's arrival counters must fit the pool");

// Workspace bytes for `p` planned for `num_sms` SMs, or -1 when the kernel does not serve the shape.
constexpr int64_t W4a16WorkspaceBytes(const W4a16Problem& p, int num_sms) {
  if (!W4a16ShapeSupported(p) || num_sms < 1) return -1;
  return LayOutW4a16Workspace(p, PlanW4a16Launch(p, num_sms)).total;
}

}  // namespace jax_w4a4::sm90::w4a16
