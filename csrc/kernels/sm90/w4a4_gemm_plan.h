// Shared-memory plan of the warp-specialized persistent W4A4 GEMM (sm_90a), host-compilable.
// The kernel static_asserts these plans; python -m jax_w4a4.budget prints them; tests/test_budget.py
// checks every amortize-vs-replicate decision.
//
// Tile: a CTA computes Yᵀ[tile_n columns of Y, tile_m tokens]: the int4 weights are the wgmma A operand
// (converted to e4m3 in registers, 64 output columns per consumer warpgroup), the activations the B
// operand in shared memory (tile_m tokens). A cluster of `cluster` CTAs runs along N: its CTAs share the
// token tile, which is multicast (activations, their scales and LA); weights, weight scales and L_up
// are private to each CTA.
//
// Pipelines, each with its own stages and per-role pipe state:
//   main      per K-stage of 128: weights, weight scales, activations, activation scales
//   low-rank  per chunk of lora_chunk ranks: L_up chunk, LA chunk (fp32 as stored), LA converted to the
//             MMA dtype, and the tile's α/β
//   epilogue  the output tile staged for the TMA store
#pragma once

#include <cstdint>

#include "common/smem_budget.h"

namespace jax_w4a4::sm90 {

struct W4A4Shape {
  int tile_n;          // output columns per CTA (wgmma M side): 64 per consumer warpgroup
  int tile_m;          // tokens per CTA (wgmma N side), multiple of 8, ≤ 256
  int cluster;         // CTAs per cluster along N (1 or 2); they multicast the token operand
  int lora_chunk;      // ranks per low-rank stage (multiple of 16)
  int act_value_bits;  // bits per activation value in shared memory (8: e4m3 codes)
};

inline constexpr int kW4A4TileK = 128;          // K per main stage: two weight groups of 64
inline constexpr int kW4A4WeightGroup = 64;
inline constexpr int kW4A4MaxMainStages = 8;
inline constexpr int kW4A4MinMainStages = 3;    // below this the MMA waits on TMA latency

// Decode tiles (few tokens) are bound by the consumers' instruction issue, not by the tensor cores: they
// convert the weights to offset codes (q + 8, cheaper) and cancel the offset with extra wgmmas whose A
// operand is a constant e4m3 tile kept in shared memory (64 rows x k32).
constexpr bool W4A4OffsetWeights(const W4A4Shape& s) { return s.tile_m <= 32; }
inline constexpr int kW4A4CorrectionBytes = 64 * 32;

struct W4A4Plan {
  static constexpr int kObjects = 11;
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
  constexpr bool fits() const {
    return total_bytes() <= budget::kSmemPerBlockSm90 && main_stages >= kW4A4MinMainStages;
  }
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
          {"weights (int4, prepacked)", s.tile_n * k / 2, main_stages, Sharing::kPrivate, Lifetime::kMainLoop, bulk},
          {"weight scales (16-bit)", s.tile_n * groups * 2, main_stages, Sharing::kPrivate, Lifetime::kMainLoop, bulk},
          {"activations", s.tile_m * k * s.act_value_bits / 8, main_stages, tokens, Lifetime::kMainLoop, swizzled},
          // int4: two 16-bit scales per 128 k; fp8: one fp32 scale per 128 k — 4 bytes per token either way.
          {"activation scales", s.tile_m * 4, main_stages, tokens, Lifetime::kMainLoop, bulk},
          {"L_up chunk (16-bit)", int64_t{s.lora_chunk} * s.tile_n * 2, lora_stages, Sharing::kPrivate,
           Lifetime::kLowRank, bulk},
          {"LA chunk (fp32, as stored)", int64_t{s.tile_m} * s.lora_chunk * 4, lora_stages, tokens,
           Lifetime::kLowRank, bulk},
          {"LA chunk (16-bit, MMA operand)", int64_t{s.tile_m} * s.lora_chunk * 2, lora_stages, Sharing::kPrivate,
           Lifetime::kLowRank, swizzled},
          {"alpha, beta (fp32)", s.tile_n * 8, lora_stages, Sharing::kPrivate, Lifetime::kLowRank, bulk},
          {"output tile staging", int64_t{s.tile_m} * s.tile_n * 2, 1, Sharing::kPrivate, Lifetime::kEpilogue, bulk},
          {"mbarriers", barriers * budget::kMbarrierBytes, 1, Sharing::kPrivate, Lifetime::kKernel, bulk},
          {"offset correction (e4m3)", W4A4OffsetWeights(s) ? kW4A4CorrectionBytes : 0, 1,
           Sharing::kPrivate, Lifetime::kKernel, bulk},
      }};
}

// Solve: the most main stages that fit with two low-rank stages; one low-rank stage only if two would
// leave fewer than the minimum main stages. Main stages come first: the seeds' lesson is that the main
// loop's depth decides whether the kernel is compute- or latency-bound.
constexpr W4A4Plan SolveW4A4Plan(W4A4Shape s) {
  W4A4Plan plan = MakeW4A4Plan(s, 1, 1);
  for (int lora_stages = 2; lora_stages >= 1; --lora_stages) {
    for (int main_stages = kW4A4MaxMainStages; main_stages >= 1; --main_stages) {
      plan = MakeW4A4Plan(s, main_stages, lora_stages);
      if (plan.total_bytes() <= budget::kSmemPerBlockSm90) break;
    }
    if (plan.fits()) return plan;
  }
  return plan;
}

// The shapes the kernel instantiates, by token count: decode (small tile_m, no cluster: the token operand
// is tiny) up to prefill (128 tokens, cluster of 2 sharing them).
inline constexpr W4A4Shape kW4A4Shapes[] = {
    {128, 8, 1, 64, 8},
    {128, 16, 1, 64, 8},
    {128, 32, 1, 64, 8},
    {128, 64, 2, 64, 8},
    {128, 128, 2, 32, 8},
};

}  // namespace jax_w4a4::sm90
