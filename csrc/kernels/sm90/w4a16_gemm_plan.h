// Shared-memory and occupancy plan of the w4a16 GEMM (csrc/kernels/sm90/w4a16_gemm.cu), host-compilable.
// The kernel builds its Config from these plans and static_asserts them; python -m jax_w4a4.budget
// prints them (csrc/common/budget_table.cc); tests/test_budget.py checks the arithmetic.
//
// A CTA owns up to 8 warps x tiles_per_warp m16 tiles of W and 8 x m_tiles tokens; one ring stage is one
// 64-wide K atom: 512 B of prepacked weights per m16 tile plus the X tile (rows padded to 144 B for
// ldmatrix). Fixed objects: the double-buffered scale table (dequantization subtrahend and scale of
// 4 groups of every row, 4 bytes each) and the split-K ticket flag. Up to 8 tokens a warp owns 4 m16 tiles
// (the X fragments, the loop and the barrier serve twice the weights: measured −9% at 1 x 28672 x 8192);
// up to 16 tokens two CTAs share an SM (the other CTA's warps issue while one waits at its barrier);
// past 16 tokens the accumulators need more registers than two CTAs of 256 threads may have, so one CTA
// per SM gets a deeper ring.
#pragma once

#include <cstdint>

#include "common/smem_budget.h"

namespace jax_w4a4::sm90::w4a16 {

inline constexpr int kAtomRows = 16;                     // one m16 MMA tile of W
inline constexpr int kAtomCols = 64;                     // four k16 MMA steps
inline constexpr int kAtomBytes = kAtomRows * kAtomCols / 2;   // 512 B = 32 lanes x 16 B
inline constexpr int kRowGranule = 32;                   // N % 32: a warp's tiles come in valid pairs
inline constexpr int kMinWarps = 4;
inline constexpr int kMaxWarps = 8;
inline constexpr int kXRowPitch = kAtomCols * 2 + 16;    // 144 B: 8 rows at one column hit 8 bank quads
inline constexpr int kGroupsPerPeriod = 4;               // even: a 64-wide atom never straddles two periods
inline constexpr int kTableEntryBytes = 4;               // 16-bit dequantization subtrahend, 16-bit scale
inline constexpr int kFlagBytes = 16;
inline constexpr int kSmemPerSm = 228 * 1024;
inline constexpr int kDriverSmemPerCta = 1024;           // reserved by the driver for every resident CTA
inline constexpr int kMinStages = 4;                     // the ring must hide HBM latency
inline constexpr int kMaxStages = 16;
inline constexpr int kMTileOptions[] = {1, 2, 4, 8};     // n8 token tiles per CTA the kernel instantiates

constexpr int CtasPerSm(int m_tiles) { return m_tiles <= 2 ? 2 : 1; }
// m16 tiles of W per warp: 4 up to 8 tokens, 2 beyond (with 16 tokens, 4 tiles' accumulators and partials
// do not fit the 128 registers per thread that two CTAs of 8 warps leave).
constexpr int TilesPerWarp(int m_tiles) { return m_tiles == 1 ? 4 : 2; }
constexpr int WarpRows(int m_tiles) { return TilesPerWarp(m_tiles) * kAtomRows; }

struct W4a16Plan {
  int m_tiles;          // n8 tiles of tokens
  int block_m;          // tokens per CTA
  int ctas_per_sm;
  int tiles_per_warp;   // m16 tiles of W per warp
  int block_rows;       // rows of W per CTA at most (kMaxWarps warps; the launcher may pick fewer)
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
  p.tiles_per_warp = TilesPerWarp(m_tiles);
  p.block_rows = kMaxWarps * WarpRows(m_tiles);
  p.stage_weight_bytes = kMaxWarps * p.tiles_per_warp * kAtomBytes;
  p.stage_x_bytes = p.block_m * kXRowPitch;
  p.stage_bytes = p.stage_weight_bytes + p.stage_x_bytes;
  p.scale_tables_bytes = 2 * kGroupsPerPeriod * p.block_rows * kTableEntryBytes;  // double-buffered
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
