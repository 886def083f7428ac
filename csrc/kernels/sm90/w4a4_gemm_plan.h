// Shared-memory plan of the warp-specialized persistent W4A4 GEMM (sm_90a), host-compilable.
// The kernel static_asserts these plans; python -m jax_w4a4.budget prints them; tests/test_budget.py
// checks every amortize-vs-replicate decision.
//
// Tile: a CTA computes Yᵀ[tile_n columns of Y, tile_m tokens]: the weights are the wgmma A operand (int4
// converted to e4m3 in registers, or, in the expanded-weights instance for long prefills, e4m3 codes that a
// pass before the GEMM wrote to the workspace, loaded by TMA and read with ldmatrix; 64 output columns per
// consumer warpgroup), the activations the B operand in shared memory (tile_m tokens). A cluster of `cluster` CTAs
// runs along N: its CTAs share the token tile, which is multicast (activations, their scales and LA);
// weights, weight scales and L_up are private to each CTA.
//
// Pipelines, each with its own stages and per-role pipe state:
//   main      per K-stage of 128: weights, weight scales, activations, activation scales
//   low-rank  per chunk of lora_chunk ranks: L_up chunk, LA chunk (fp32 as stored), LA converted to the
//             MMA dtype, and the tile's α/β
//   epilogue  the output tile staged for the TMA store
#pragma once

#include <cstdint>

#include "common/arrival_counters.h"
#include "common/smem_budget.h"

namespace jax_w4a4::sm90 {

struct W4A4Shape {
  int tile_n;          // output columns per CTA (wgmma M side): 64 per consumer warpgroup
  int tile_m;          // tokens per CTA (wgmma N side), multiple of 8, ≤ 256
  int cluster;         // CTAs per cluster along N (1 or 2); they multicast the token operand
  int lora_chunk;      // ranks per low-rank stage (multiple of 16)
  int act_value_bits;  // bits per activation value in shared memory (8: e4m3 codes)
  bool expanded_weights = false;  // e4m3 weights expanded per call (W4A4ExpandedWeightsBytes), 16 KB TMA stages
};

inline constexpr int kW4A4TileK = 128;          // K per main stage: two weight groups of 64
inline constexpr int kW4A4WeightGroup = 64;
inline constexpr int kW4A4MaxMainStages = 8;
inline constexpr int kW4A4MinMainStages = 3;    // below this the MMA waits on TMA latency

// Decode tiles (few tokens) are bound by the consumers' instruction issue, not by the tensor cores: they
// convert the weights to offset codes (q + 8, cheaper) and cancel the offset at promotion with the token's
// code sum S = Σ_{k in group} x[m, k], which its promotion record brings (W4A4PromotionRecordsBytes).
// (Until session 48 a second wgmma after every k32 wgmma, A = the constant -8·2^-9, did it on the tensor
// cores: 4.4% of 16 x 28672 x 8192 and 6.4% at 32 tokens, benchmarks/NOTES.md.)
constexpr bool W4A4OffsetWeights(const W4A4Shape& s) { return s.tile_m <= 32; }

// Prefill tiles with 16-bit activation scales form the per-group scale products s_w[n]·s_x[m] on the tensor
// cores: one wgmma m64nNk16 bf16/fp16 per unit (A = the two weight-group scales in registers, B = the
// activation scales in shared memory; products of 16-bit values are exact in fp32), so a promotion is one
// FFMA per accumulator instead of FMUL + FFMA and the scales are neither loaded nor decoded by the consumers.
// Decode tiles promote on the ALU: at 16 tokens the extra wgmma per unit cost more than it saved (session 8:
// 16 x 28672 x 8192 48.0 -> 50.9 us), and with the promotion records the 32-token tile gains too (session 49).
constexpr bool W4A4ScaleProductMma(const W4A4Shape& s) { return !W4A4OffsetWeights(s); }
// Per token and main stage 16 bytes in shared memory. Decode tiles: the promotion records of the stage's two
// groups. Prefill tiles: the 4-byte scale word (two 16-bit scales, or fp32 for fp8 activations), then zeros,
// so that the 16 bytes are the scale wgmma's K-major B row (k = 0, 1: the scale word).
inline constexpr int kW4A4ActScalePitch = 16;

// Expanded weights (prefill from kW4A4ExpandedWeightsMinTokens tokens): the GEMM's consumers spent ~18% of
// a long prefill turning int4 fragments into e4m3 in registers (16-byte loads, prmt tables, wgmma with A from
// registers). Instead a pass before the GEMM expands the whole weight matrix into e4m3 codes, (n, k) row-major
// bytes in the workspace (N x K bytes: 64 MB at 8192²), and the GEMM's TMA brings 16 KB stages of them into
// shared memory with the activations' swizzle (3 main stages, against 6 beside one low-rank stage). The pass
// streams 1.5 N x K bytes, once per call, so it pays from some hundreds of tokens. Session 19
// (benchmarks/NOTES.md), us, prepacked -> expanded: 8192³ 1708-1718 -> 1397; 1024 x 8192² 228 -> 203;
// 768 tokens: 8192² 175 -> 159, 4096² 64 -> 56, 28672 x 8192 603 -> 564; 512 tokens: 8192² 122 -> 117 but
// 28672 x 8192 389 -> 396; 256 tokens: 8192² 63 -> 75.
inline constexpr int64_t kW4A4ExpandedWeightsMinTokens = 768;

// The expanded weights in the workspace: one e4m3 byte per value, (n, k) row-major.
constexpr int64_t W4A4ExpandedWeightsBytes(int64_t n, int64_t k) { return n * k; }

// CTAs per SM an instance is built for (__launch_bounds__, registers, shared memory). Decode tiles up to
// 16 tokens issue little per stage and wait on the latency of each warp's chain (LDS, conversion, wgmma,
// promotion): two independent CTAs per SM hide it. Larger tiles need the registers and shared memory of one.
constexpr int W4A4CtasPerSm(const W4A4Shape& s) { return W4A4OffsetWeights(s) && s.tile_m <= 16 ? 2 : 1; }

// The epilogue stages at most this many tokens of a consumer warpgroup's 64 columns at a time (a TMA store each):
// the 256-token tile stores its tokens in two passes, so its staging takes 32 KB, not 64.
inline constexpr int kW4A4MaxStagedTokens = 128;
constexpr int W4A4StagedTokens(const W4A4Shape& s) {
  return s.tile_m < kW4A4MaxStagedTokens ? s.tile_m : kW4A4MaxStagedTokens;
}

// The kernel aligns its shared-memory base to 1 KB, so it allocates the plan's bytes + 1 KB.
inline constexpr int64_t kW4A4SmemAlignSlack = budget::kSwizzledAlign;

// Plan bytes one CTA may use: its share of the SM (less the driver's reservation and the alignment slack),
// at most the per-block limit.
constexpr int64_t W4A4SmemLimit(const W4A4Shape& s) {
  const int64_t share = budget::kSmemPerSmSm90 / W4A4CtasPerSm(s) - budget::kSmemReservedPerCtaSm90;
  const int64_t block = share < budget::kSmemPerBlockSm90 ? share : budget::kSmemPerBlockSm90;
  return block - kW4A4SmemAlignSlack;
}

struct W4A4Plan {
  static constexpr int kObjects = 10;
  W4A4Shape shape;
  int main_stages;
  int lora_stages;
  budget::SmemObject objects[kObjects];

  constexpr int64_t main_stage_bytes() const {
    int64_t sum = 0;
    for (const auto& o : objects)
      if (o.lifetime == budget::Lifetime::kMainLoop) sum += o.footprint() / o.stages;
    return sum;
  }
  // What a main stage's "full" barrier expects: every main-loop object, whole tiles (multicast too).
  constexpr int64_t main_stage_tx_bytes() const {
    int64_t sum = 0;
    for (const auto& o : objects)
      if (o.lifetime == budget::Lifetime::kMainLoop) sum += o.expected_tx_bytes();
    return sum;
  }
  // What one CTA issues per main stage: its private objects whole, its slice of the multicast ones.
  constexpr int64_t main_stage_issued_bytes() const {
    int64_t sum = 0;
    for (const auto& o : objects)
      if (o.lifetime == budget::Lifetime::kMainLoop) sum += o.issued_bytes(shape.cluster);
    return sum;
  }
  constexpr int64_t total_bytes() const {
    int64_t sum = 0;
    for (const auto& o : objects) sum += o.footprint();
    return sum;
  }
  constexpr int ctas_per_sm() const { return W4A4CtasPerSm(shape); }
  constexpr int64_t smem_limit() const { return W4A4SmemLimit(shape); }
  constexpr bool fits() const { return total_bytes() <= smem_limit() && main_stages >= kW4A4MinMainStages; }
};

constexpr W4A4Plan MakeW4A4Plan(W4A4Shape s, int main_stages, int lora_stages) {
  using budget::Lifetime;
  using budget::Sharing;
  const Sharing tokens = s.cluster > 1 ? Sharing::kMulticast : Sharing::kPrivate;
  const int64_t k = kW4A4TileK;
  const int64_t groups = k / kW4A4WeightGroup;
  const int barriers = 2 * main_stages + 2 * lora_stages + 2;  // full + empty per stage, per pipeline
  const int64_t bulk = budget::kBulkAlign;
  const int64_t swizzled = budget::kSwizzledAlign;
  return W4A4Plan{
      s,
      main_stages,
      lora_stages,
      {
          // Expanded: TMA boxes with the 128-byte swizzle, as the activations (ldmatrix reads them conflict-free).
          {s.expanded_weights ? "weights (e4m3, expanded)" : "weights (int4, prepacked)",
           s.expanded_weights ? s.tile_n * k : s.tile_n * k / 2, main_stages, Sharing::kPrivate, Lifetime::kMainLoop,
           s.expanded_weights ? swizzled : bulk},
          {"weight scales (16-bit)", s.tile_n * groups * 2, main_stages, Sharing::kPrivate, Lifetime::kMainLoop, bulk},
          {"activations", s.tile_m * k * s.act_value_bits / 8, main_stages, tokens, Lifetime::kMainLoop, swizzled},
          // kW4A4ActScalePitch bytes per token: decode tiles' promotion records, prefill tiles' scale words
          // (int4: two 16-bit scales per 128 k; fp8: one fp32 scale per 128 k).
          {"activation scales", int64_t{s.tile_m} * kW4A4ActScalePitch, main_stages, tokens, Lifetime::kMainLoop,
           bulk},
          {"L_up chunk (16-bit)", int64_t{s.lora_chunk} * s.tile_n * 2, lora_stages, Sharing::kPrivate,
           Lifetime::kLowRank, bulk},
          {"LA chunk (fp32, as stored)", int64_t{s.tile_m} * s.lora_chunk * 4, lora_stages, tokens,
           Lifetime::kLowRank, bulk},
          {"LA chunk (16-bit, MMA operand)", int64_t{s.tile_m} * s.lora_chunk * 2, lora_stages, Sharing::kPrivate,
           Lifetime::kLowRank, swizzled},
          {"alpha, beta (fp32)", s.tile_n * 8, lora_stages, Sharing::kPrivate, Lifetime::kLowRank, bulk},
          {"output tile staging", int64_t{W4A4StagedTokens(s)} * s.tile_n * 2, 1, Sharing::kPrivate,
           Lifetime::kEpilogue, bulk},
          {"mbarriers", barriers * budget::kMbarrierBytes, 1, Sharing::kPrivate, Lifetime::kKernel, bulk},
      }};
}

// The most main stages that fit beside `lora_stages` low-rank stages (down to one; fits() says whether enough).
constexpr W4A4Plan MostMainStages(W4A4Shape s, int lora_stages) {
  W4A4Plan plan = MakeW4A4Plan(s, 1, lora_stages);
  for (int main_stages = kW4A4MaxMainStages; main_stages >= 1; --main_stages) {
    plan = MakeW4A4Plan(s, main_stages, lora_stages);
    if (plan.total_bytes() <= plan.smem_limit()) break;
  }
  return plan;
}

// A second low-rank stage lets a tile's first low-rank chunk arrive while the previous tile finishes; it is
// worth less than two main stages. Session 20, a build with one low-rank stage wherever that bought a main
// stage: the 128-token tile 4 -> 6 main stages, 512 x 8192² 121 -> 117 us; the 16-token tile 5 -> 7, 16 x
// 28672 x 8192 41.7 -> 41.5-41.6 us; the expanded-weights tile 3 -> 4, 8192³ 1391-1396 -> 1401-1403 us (a
// loss); the 8- and 64-token tiles one more, unchanged.
inline constexpr int kW4A4MainStagesPerLoraStage = 2;

// Solve: the most main stages with two low-rank stages, unless one low-rank stage buys
// kW4A4MainStagesPerLoraStage more main stages or two would leave fewer than the minimum. Main stages
// come first: the seeds' lesson is that the main loop's depth decides whether the kernel is compute- or
// latency-bound.
constexpr W4A4Plan SolveW4A4Plan(W4A4Shape s) {
  const W4A4Plan two = MostMainStages(s, 2);
  const W4A4Plan one = MostMainStages(s, 1);
  if (!two.fits() || one.main_stages >= two.main_stages + kW4A4MainStagesPerLoraStage) return one;
  return two;
}

// The shapes the kernel instantiates, by token count: decode tiles up to 64 tokens without a cluster (their
// token operand is small, and stream-K can deal their few column tiles over every SM: 64 x 8192² ran on 64
// CTAs as clusters of 2, 47.6 -> 29.5 us with stream-K, session 9) up to prefill (128 tokens, cluster of 2
// sharing them), then on expanded weights from kW4A4ExpandedWeightsMinTokens tokens the same prefill tile and a
// 256-token one (W4A4LaunchShapeIndex picks).
inline constexpr W4A4Shape kW4A4Shapes[] = {
    {128, 8, 1, 64, 8},
    {128, 16, 1, 64, 8},
    {128, 32, 1, 64, 8},
    {128, 64, 1, 64, 8},
    {128, 128, 2, 32, 8},
    {128, 128, 2, 32, 8, true},
    {128, 256, 2, 16, 8, true},
};

inline constexpr int kW4A4ShapeCount = sizeof(kW4A4Shapes) / sizeof(kW4A4Shapes[0]);
inline constexpr int kW4A4ExpandedShape = kW4A4ShapeCount - 2;      // 128 tokens on expanded weights
inline constexpr int kW4A4ExpandedWideShape = kW4A4ShapeCount - 1;  // 256 tokens on expanded weights

// The token tile that serves M tokens: the smallest that holds them (128 beyond), on expanded weights from
// kW4A4ExpandedWeightsMinTokens (where W4A4LaunchShapeIndex may widen it; the workspace and stream-K follow
// from this one).
constexpr int W4A4ShapeIndexForTokens(int64_t m) {
  if (m >= kW4A4ExpandedWeightsMinTokens) return kW4A4ExpandedShape;
  for (int i = 0; i + 1 < kW4A4ExpandedShape; ++i) {
    if (m <= kW4A4Shapes[i].tile_m) return i;
  }
  return kW4A4ExpandedShape - 1;
}
static_assert(kW4A4Shapes[kW4A4ExpandedShape].expanded_weights &&
                  kW4A4Shapes[kW4A4ExpandedWideShape].expanded_weights &&
                  !kW4A4Shapes[kW4A4ExpandedShape - 1].expanded_weights &&
                  kW4A4Shapes[kW4A4ExpandedShape].cluster > 1 && kW4A4Shapes[kW4A4ExpandedWideShape].cluster > 1 &&
                  kW4A4Shapes[kW4A4ExpandedWideShape].tile_m == 2 * kW4A4Shapes[kW4A4ExpandedShape].tile_m,
              "the last two instances are the prefill tiles on expanded weights, 128 and 256 tokens (no stream-K: "
              "their workspace is the weights)");

// Rounds of the persistent grid over an expanded-weights tile's cluster tiles: clusters of 2 CTAs, one CTA per SM,
// so num_sms / 2 clusters at once (66 on an H200, as cudaOccupancyMaxActiveClusters says).
constexpr int64_t W4A4PrefillRounds(int64_t m, int64_t n, const W4A4Shape& s, int num_sms) {
  const int64_t column_groups = (n / s.tile_n + s.cluster - 1) / s.cluster;
  const int64_t cluster_tiles = (m + s.tile_m - 1) / s.tile_m * column_groups;
  const int64_t clusters = num_sms / s.cluster > 1 ? num_sms / s.cluster : 1;
  return (cluster_tiles + clusters - 1) / clusters;
}

// The instance a launch runs: the token tile's, or on expanded weights the 256-token tile where its rounds of twice
// the work take no more rounds of 128-token work than the 128-token tile's (768 x 8192 x N: 2 rounds against 3, so
// 128 tokens). A 256-token tile streams half the weight bytes per token that a 128-token one does (session 53,
// us, 128 -> 256 tokens: 8192³ 1398-1403 -> 1328-1337, 4096 x 3072 x 12288 402-404 -> 381-383, 4096 x 12288 x 3072
// 422-423 -> 418-420). fp8 activations keep the 128-token tile: they promote on the ALU (their scales are fp32, no
// scale wgmma), and the scale words beside the 256-token tile's 128 accumulator registers spilled inside its main
// loop (136 bytes).
constexpr int W4A4LaunchShapeIndex(int64_t m, int64_t n, int num_sms, bool fp8_activations) {
  const int index = W4A4ShapeIndexForTokens(m);
  if (index != kW4A4ExpandedShape || fp8_activations) return index;
  const W4A4Shape& tile = kW4A4Shapes[kW4A4ExpandedShape];
  const W4A4Shape& wide = kW4A4Shapes[kW4A4ExpandedWideShape];
  const bool wide_pays = W4A4PrefillRounds(m, n, wide, num_sms) * wide.tile_m <=
                         W4A4PrefillRounds(m, n, tile, num_sms) * tile.tile_m;
  return wide_pays ? kW4A4ExpandedWideShape : index;
}

// ---- Stream-K (decode tiles, no cluster)
// The persistent grid runs whole tiles in rounds; when the tiles do not divide over the CTAs (28672
// columns = 224 tiles on 132 SMs: 2 rounds where 1.7 would do; 8192 columns = 64 tiles: half the SMs
// idle) the (tile, k-stage) iterations are instead dealt evenly: CTA b runs [b T / G, (b + 1) T / G).
// A tile cut by a range boundary is finished (low-rank, epilogue) by the CTA that runs its first
// k-stage; the CTAs that run its later k-stages do so first in their ranges and leave fp32 partials in
// the workspace, one slot per CTA and consumer warpgroup, each published by a flag (2 per CTA,
// common/arrival_counters.h).
inline constexpr int kW4A4StreamKMinStagesPerCta = 4;  // below this the per-CTA fixed costs dominate

constexpr bool W4A4UsesStreamK(int64_t m, int64_t n, int64_t k, int64_t ctas) {
  const W4A4Shape s = kW4A4Shapes[W4A4ShapeIndexForTokens(m)];
  if (s.cluster != 1 || ctas < 1 || m < 1 || n < s.tile_n || k < kW4A4TileK) return false;
  const int64_t tiles = (m + s.tile_m - 1) / s.tile_m * (n / s.tile_n);
  const int64_t iterations = tiles * (k / kW4A4TileK);
  return tiles % ctas != 0 && iterations >= kW4A4StreamKMinStagesPerCta * ctas &&
         iterations * ctas < (int64_t{1} << 31);  // the kernel's range arithmetic is 32-bit
}

// Stream-K workspace for `ctas` CTAs of token tile `tile_m`: one fp32 partial tile per CTA.
constexpr int64_t W4A4StreamKWorkspaceBytes(int tile_m, int64_t ctas) {
  return ctas * int64_t{kW4A4Shapes[0].tile_n} * tile_m * 4;
}

// The W4A4 linear's token handoff (w4a4_gemm.cu, WaitForTokens): act_quant's CTAs count on the ready counter,
// the GEMM's CTAs on the taken counter, the last of them re-arms both. The last two counters of the pool.
inline constexpr int64_t kW4A4TokensReadyCounter = kArrivalCounters - 2;
inline constexpr int64_t kW4A4TokensTakenCounter = kArrivalCounters - 1;

// The flags of every CTA the GPU holds at once fit the pool for every num_sms the handlers accept.
constexpr bool W4A4FlagsFitPool() {
  for (const W4A4Shape& s : kW4A4Shapes) {
    if (2 * int64_t{kMaxNumSms} * W4A4CtasPerSm(s) > kW4A4TokensReadyCounter) return false;
  }
  return true;
}
static_assert(W4A4FlagsFitPool(), "w4a4's stream-K flags must fit the pool below the token-handoff counters");

// Stream-K partials of one launch planned for num_sms SMs (0 without stream-K).
constexpr int64_t W4A4PartialsBytes(int64_t m, int64_t n, int64_t k, int64_t num_sms) {
  const W4A4Shape s = kW4A4Shapes[W4A4ShapeIndexForTokens(m)];
  const int64_t ctas = num_sms * W4A4CtasPerSm(s);
  return W4A4UsesStreamK(m, n, k, ctas) ? W4A4StreamKWorkspaceBytes(s.tile_m, ctas) : 0;
}

// Decode tiles' promotion records, (m, k/64) row-major, 8 bytes each: per token and group g the activation
// scale s (fp32) and c = -8·2^-9·S·s, with S = Σ_{k in group g} x[m, k] the values of the e4m3 codes summed
// in fp32 (common/promotion_records.h). S is exact in any order: e4m3 values are multiples of 2^-9 and 64 of
// them sum to less than 64 x 448 < 2^15, so every partial sum fits fp32's 24-bit significand; act_quant (in the
// W4A4 linear) and the GEMM's own pass over q_x and s_x (alone) give the same bits. They follow the partials
// in the workspace.
inline constexpr int kW4A4PromotionRecordBytes = 8;
constexpr int64_t W4A4PromotionRecordsBytes(int64_t m, int64_t k) {
  return W4A4OffsetWeights(kW4A4Shapes[W4A4ShapeIndexForTokens(m)])
             ? m * (k / kW4A4WeightGroup) * kW4A4PromotionRecordBytes
             : 0;
}
constexpr int64_t W4A4PromotionRecordsOffset(int64_t m, int64_t n, int64_t k, int64_t num_sms) {
  return (W4A4PartialsBytes(m, n, k, num_sms) + 255) / 256 * 256;
}

// Workspace bytes of one launch planned for num_sms SMs, for the instance's CTAs per SM: the expanded
// weights, or the stream-K partials and the promotion records, or 0. The FFI lowering sizes the op's workspace
// result with it (jax_w4a4/ops/primitives.py).
constexpr int64_t W4A4WorkspaceBytes(int64_t m, int64_t n, int64_t k, int64_t num_sms) {
  const W4A4Shape s = kW4A4Shapes[W4A4ShapeIndexForTokens(m)];
  if (s.expanded_weights) return W4A4ExpandedWeightsBytes(n, k);
  const int64_t records = W4A4PromotionRecordsBytes(m, k);
  return records > 0 ? W4A4PromotionRecordsOffset(m, n, k, num_sms) + records : W4A4PartialsBytes(m, n, k, num_sms);
}
static_assert(kW4A4Shapes[0].tile_n == 128 && kW4A4Shapes[1].tile_n == 128 && kW4A4Shapes[2].tile_n == 128,
              "stream-K partial slots are sized with the decode tiles' common width");

}  // namespace jax_w4a4::sm90
