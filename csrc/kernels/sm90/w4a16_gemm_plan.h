// Shared-memory and occupancy plan of the w4a16 GEMM (csrc/kernels/sm90/w4a16_gemm.cu), host-compilable.
// The kernel builds its Config from these plans and static_asserts them; python -m jax_w4a4.budget
// prints them (csrc/common/budget_table.cc); tests/test_budget.py checks the arithmetic.
//
// A CTA owns up to 256 rows of W (8 warps x two m16 tiles) and 8 x m_tiles tokens; one ring stage is one
// 64-wide K atom: 8 KB of prepacked weights plus the X tile (rows padded to 144 B for ldmatrix). Fixed
// objects: the double-buffered scale tables (fp32 scales and dequantization subtrahends of 4 groups of
// every row) and the split-K ticket flag. Up to 16 tokens two CTAs share an SM (the other CTA's warps
// issue while one waits at its per-stage barrier); past that the accumulators need more registers than
// two CTAs of 256 threads may have, so one CTA per SM gets a deeper ring.
#pragma once

#include <cstdint>

#include "common/smem_budget.h"

namespace jax_w4a4::sm90::w4a16 {

inline constexpr int kAtomRows = 16;                     // one m16 MMA tile of W
inline constexpr int kAtomCols = 64;                     // four k16 MMA steps
inline constexpr int kAtomBytes = kAtomRows * kAtomCols / 2;   // 512 B = 32 lanes x 16 B
inline constexpr int kTilesPerWarp = 2;                  // m16 tiles of W per warp
inline constexpr int kWarpRows = kTilesPerWarp * kAtomRows;    // 32
inline constexpr int kMinWarps = 4;
inline constexpr int kMaxWarps = 8;
inline constexpr int kMaxBlockRows = kMaxWarps * kWarpRows;    // 256 rows of W per CTA at most
inline constexpr int kStageWeightBytes = kMaxWarps * kTilesPerWarp * kAtomBytes;  // 8 KB
inline constexpr int kXRowPitch = kAtomCols * 2 + 16;    // 144 B: 8 rows at one column hit 8 bank quads
inline constexpr int kGroupsPerPeriod = 4;               // even: a 64-wide atom never straddles two periods
inline constexpr int kTableEntries = kGroupsPerPeriod * kMaxBlockRows;  // one buffer of one table
// Two tables (dequantization subtrahends, fp32 scales), each double-buffered: 16 KB.
inline constexpr int kScaleTablesBytes = 2 * 2 * kTableEntries * 4;
inline constexpr int kFlagBytes = 16;
inline constexpr int kSmemPerSm = 228 * 1024;
inline constexpr int kDriverSmemPerCta = 1024;           // reserved by the driver for every resident CTA
inline constexpr int kMinStages = 4;                     // the ring must hide HBM latency
inline constexpr int kMaxStages = 16;
inline constexpr int kMTileOptions[] = {1, 2, 4, 8};     // n8 token tiles per CTA the kernel instantiates

constexpr int CtasPerSm(int m_tiles) { return m_tiles <= 2 ? 2 : 1; }

struct W4a16Plan {
  int m_tiles;          // n8 tiles of tokens
  int block_m;          // tokens per CTA
  int ctas_per_sm;
  int stages;
  int stage_weight_bytes;
  int stage_x_bytes;
  int stage_bytes;
  int ring_bytes;
  int scale_tables_bytes;
  int flag_bytes;
  int total_bytes;      // dynamic shared memory per CTA
  int per_sm_bytes;     // ctas_per_sm x (total + the driver's reservation)

  constexpr bool fits() const {
    return stages >= kMinStages && total_bytes <= budget::kSmemPerBlockSm90 && per_sm_bytes <= kSmemPerSm;
  }
};

// The deepest ring (up to kMaxStages) that lets CtasPerSm(m_tiles) CTAs share the SM.
constexpr W4a16Plan SolveW4a16Plan(int m_tiles) {
  W4a16Plan p{};
  p.m_tiles = m_tiles;
  p.block_m = 8 * m_tiles;
  p.ctas_per_sm = CtasPerSm(m_tiles);
  p.stage_weight_bytes = kStageWeightBytes;
  p.stage_x_bytes = p.block_m * kXRowPitch;
  p.stage_bytes = p.stage_weight_bytes + p.stage_x_bytes;
  p.scale_tables_bytes = kScaleTablesBytes;
  p.flag_bytes = kFlagBytes;
  const int per_cta = kSmemPerSm / p.ctas_per_sm - kDriverSmemPerCta;
  const int fit = (per_cta - p.scale_tables_bytes - p.flag_bytes) / p.stage_bytes;
  p.stages = fit < kMaxStages ? fit : kMaxStages;
  p.ring_bytes = p.stages * p.stage_bytes;
  p.total_bytes = p.ring_bytes + p.scale_tables_bytes + p.flag_bytes;
  p.per_sm_bytes = p.ctas_per_sm * (p.total_bytes + kDriverSmemPerCta);
  return p;
}

}  // namespace jax_w4a4::sm90::w4a16
