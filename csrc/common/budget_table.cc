// Host-only libjax_w4a4_budget.so: the kernels' compile-time shared-memory plans, readable from Python
// (python -m jax_w4a4.budget, tests/test_budget.py) on any machine, GPU or not. It includes the same
// plan headers the kernels static_assert, so what is printed is what is compiled.
#include <cstdint>
#include <cstdio>
#include <string>

#include "common/arrival_counters.h"
#include "kernels/sm90/act_quant_plan.h"
#include "kernels/sm90/w4a16_gemm_plan.h"
#include "kernels/sm90/w4a4_gemm_plan.h"

namespace {

using jax_w4a4::budget::Lifetime;
using jax_w4a4::budget::Sharing;
using jax_w4a4::sm90::ActQuantPlan;
using jax_w4a4::sm90::W4A4Plan;
using jax_w4a4::sm90::w4a16::W4a16Plan;

const char* LifetimeName(Lifetime l) {
  switch (l) {
    case Lifetime::kMainLoop: return "main K-stage";
    case Lifetime::kLowRank: return "low-rank stage";
    case Lifetime::kEpilogue: return "epilogue";
    case Lifetime::kKernel: return "kernel";
  }
  return "?";
}

std::string Describe(const W4A4Plan& p) {
  char line[256];
  std::string out;
  const auto& s = p.shape;
  std::snprintf(line, sizeof line,
                "w4a4_gemm sm90: tile %d cols x %d tokens x %d k, cluster %d, low-rank chunk %d, "
                "activations %d-bit%s\n",
                s.tile_n, s.tile_m, jax_w4a4::sm90::kW4A4TileK, s.cluster, s.lora_chunk, s.act_value_bits,
                s.expanded_weights ? ", expanded weights" : "");
  out += line;
  std::snprintf(line, sizeof line, "  %-32s %10s %7s %10s %10s %-10s %s\n", "object", "bytes", "stages",
                "footprint", "issued", "multicast", "lifetime");
  out += line;
  for (const auto& o : p.objects) {
    std::snprintf(line, sizeof line, "  %-32s %10lld %7d %10lld %10lld %-10s %s\n", o.name,
                  static_cast<long long>(o.bytes), o.stages, static_cast<long long>(o.footprint()),
                  static_cast<long long>(o.issued_bytes(s.cluster)),
                  o.sharing == Sharing::kMulticast ? "yes" : "no", LifetimeName(o.lifetime));
    out += line;
  }
  std::snprintf(line, sizeof line,
                "  total %lld of %lld bytes (%d CTA/SM); main stages %d (tx %lld B/stage, issued %lld B/stage/CTA), "
                "low-rank stages %d%s\n",
                static_cast<long long>(p.total_bytes()), static_cast<long long>(p.smem_limit()), p.ctas_per_sm(),
                p.main_stages, static_cast<long long>(p.main_stage_tx_bytes()),
                static_cast<long long>(p.main_stage_issued_bytes()), p.lora_stages, p.fits() ? "" : "  ** DOES NOT FIT **");
  out += line;
  return out;
}

std::string DescribeActQuant(const ActQuantPlan& p) {
  char line[512];
  std::snprintf(line, sizeof line,
                "act_quant sm90: %d rows x rank <= %d: %d threads, %d CTAs/SM (<= %d registers), quantizer "
                "%d pass(es) x %d unit(s); stage %lld B (X %lld + lambdas %lld + L_down %lld) x %d stages = %lld, "
                "column table %lld, mbarriers %lld, alignment slack %lld; total %lld B/CTA, %lld of %lld B/SM%s\n",
                p.shape.block_rows, p.shape.rank_cap, p.threads, p.ctas_per_sm, p.max_registers(), p.passes,
                p.units_per_pass, static_cast<long long>(p.stage_bytes), static_cast<long long>(p.x_tile_bytes),
                static_cast<long long>(p.lambda_bytes), static_cast<long long>(p.lora_tile_bytes), p.stages,
                static_cast<long long>(p.ring_bytes), static_cast<long long>(p.column_table_bytes),
                static_cast<long long>(p.barrier_bytes), static_cast<long long>(jax_w4a4::budget::kSwizzledAlign),
                static_cast<long long>(p.total_bytes),
                static_cast<long long>(p.per_sm_bytes()), static_cast<long long>(jax_w4a4::budget::kSmemPerSmSm90),
                p.fits() ? "" : "  ** DOES NOT FIT **");
  return line;
}

const char* W4a16FormName(jax_w4a4::sm90::w4a16::W4a16Form form) {
  using jax_w4a4::sm90::w4a16::W4a16Form;
  switch (form) {
    case W4a16Form::kNarrow: return "narrow (k-lanes share the rows, a producer warp)";
    case W4a16Form::kNarrow32: return "narrow32 (narrow, 2 m16 tiles)";
    case W4a16Form::kWhole: return "whole-SM (one CTA holds the SM)";
    case W4a16Form::kWhole7: return "whole7 (whole-SM, 7 m16 tiles)";
    default: return "wide";
  }
}

std::string DescribeW4a16(const W4a16Plan& p) {
  char line[512];
  std::snprintf(line, sizeof line,
                "w4a16_gemm sm90: %d tokens per CTA, %s, %d CTAs/SM of <= %d warps, %d m16 tiles a warp (%d rows): "
                "stage of %d atoms %d B (weights %d + X %d + scales and zeros %d) x %d stages = %d, barriers %d, "
                "cluster sums %d, alignment slack %d; total %d B/CTA, %d of %d B/SM; k-lane sums %d in the ring%s\n",
                p.block_m, W4a16FormName(p.form), p.ctas_per_sm,
                p.max_warps, p.tiles_per_warp, p.block_rows, p.stage_atoms, p.stage_bytes, p.stage_weight_bytes,
                p.stage_x_bytes, p.stage_scale_bytes, p.stages,
                p.ring_bytes, p.barrier_bytes, p.cluster_sum_bytes, static_cast<int>(jax_w4a4::budget::kSwizzledAlign),
                p.total_bytes,
                p.per_sm_bytes,
                static_cast<int>(jax_w4a4::budget::kSmemPerSmSm90), p.lane_sum_bytes,
                p.fits() ? "" : "  ** DOES NOT FIT **");
  return line;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) const char* JaxW4a4BudgetTable() {
  static const std::string table = [] {
    std::string t;
    for (const auto& shape : jax_w4a4::sm90::kW4A4Shapes) t += Describe(jax_w4a4::sm90::SolveW4A4Plan(shape)) + "\n";
    for (const auto& shape : jax_w4a4::sm90::kActQuantShapes) t += DescribeActQuant(jax_w4a4::sm90::SolveActQuantPlan(shape));
    t += "\n";
    namespace w4a16 = jax_w4a4::sm90::w4a16;
    for (int m_tiles : w4a16::kMTileOptions) t += DescribeW4a16(w4a16::SolveW4a16Plan(m_tiles));
    for (const w4a16::W4a16Form form : w4a16::kWholeForms) {
      for (int m_tiles : w4a16::kMTileOptions) {
        if (w4a16::HasForm(m_tiles, form)) t += DescribeW4a16(w4a16::SolveW4a16Plan(m_tiles, form));
      }
    }
    for (int m_tiles : w4a16::kMTileOptions) {
      if (m_tiles > w4a16::kMaxMmaSyncMTiles) continue;
      t += DescribeW4a16(w4a16::SolveW4a16Plan(m_tiles, w4a16::W4a16Form::kNarrow));
      t += DescribeW4a16(w4a16::SolveW4a16Plan(m_tiles, w4a16::W4a16Form::kNarrow32));
    }
    return t;
  }();
  return table.c_str();
}

// The solved plan for any shape, flattened for ctypes: out[0..7] = main_stages, lora_stages, total bytes,
// main-stage bytes, main-stage tx bytes, main-stage issued bytes, CTAs per SM, the per-CTA byte limit the
// plan was solved against; then per object 7 values: bytes, stages,
// sharing, lifetime, footprint, issued bytes, expected tx bytes. Returns the number of objects.
__attribute__((visibility("default"))) int JaxW4a4W4A4Plan(int tile_n, int tile_m, int cluster, int lora_chunk,
                                                            int act_value_bits, int expanded_weights, int64_t* out) {
  const W4A4Plan p =
      jax_w4a4::sm90::SolveW4A4Plan({tile_n, tile_m, cluster, lora_chunk, act_value_bits, expanded_weights != 0});
  int64_t* o = out;
  *o++ = p.main_stages;
  *o++ = p.lora_stages;
  *o++ = p.total_bytes();
  *o++ = p.main_stage_bytes();
  *o++ = p.main_stage_tx_bytes();
  *o++ = p.main_stage_issued_bytes();
  *o++ = p.ctas_per_sm();
  *o++ = p.smem_limit();
  for (const auto& obj : p.objects) {
    *o++ = obj.bytes;
    *o++ = obj.stages;
    *o++ = static_cast<int64_t>(obj.sharing);
    *o++ = static_cast<int64_t>(obj.lifetime);
    *o++ = obj.footprint();
    *o++ = obj.issued_bytes(cluster);
    *o++ = obj.expected_tx_bytes();
  }
  return W4A4Plan::kObjects;
}

// The objects' names: the same for every shape but the weights' (int4 prepacked or e4m3 expanded).
__attribute__((visibility("default"))) const char* JaxW4a4W4A4ObjectName(int index, int expanded_weights) {
  static const W4A4Plan prepacked = jax_w4a4::sm90::SolveW4A4Plan(jax_w4a4::sm90::kW4A4Shapes[0]);
  static const W4A4Plan expanded =
      jax_w4a4::sm90::SolveW4A4Plan(jax_w4a4::sm90::kW4A4Shapes[jax_w4a4::sm90::kW4A4ShapeCount - 1]);
  const W4A4Plan& p = expanded_weights != 0 ? expanded : prepacked;
  return index >= 0 && index < W4A4Plan::kObjects ? p.objects[index].name : "";
}

// The act_quant plans, flattened for ctypes. JaxW4a4ActQuantShapes writes (block_rows, rank_cap) of every
// instantiated shape into out (2 per shape) and returns the count. JaxW4a4ActQuantPlan writes the solved
// plan of one shape: warps, threads, ctas_per_sm, units_per_pass, passes, stages, x_tile, lambdas,
// lora_row_pitch, lora_tile, stage, ring, column_table, barriers, total, per_sm, max_registers, fits (18 values).
__attribute__((visibility("default"))) int JaxW4a4ActQuantShapes(int64_t* out) {
  int n = 0;
  for (const auto& shape : jax_w4a4::sm90::kActQuantShapes) {
    out[2 * n] = shape.block_rows;
    out[2 * n + 1] = shape.rank_cap;
    ++n;
  }
  return n;
}

__attribute__((visibility("default"))) void JaxW4a4ActQuantPlan(int block_rows, int rank_cap, int64_t* out) {
  const ActQuantPlan p = jax_w4a4::sm90::SolveActQuantPlan({block_rows, rank_cap});
  const int64_t values[] = {p.warps,         p.threads,           p.ctas_per_sm,    p.units_per_pass, p.passes,
                            p.stages,        p.x_tile_bytes,      p.lambda_bytes,   p.lora_row_pitch, p.lora_tile_bytes,
                            p.stage_bytes,   p.ring_bytes,        p.column_table_bytes, p.barrier_bytes, p.total_bytes,
                            p.per_sm_bytes(), p.max_registers(),  p.fits() ? 1 : 0};
  for (int64_t v : values) *out++ = v;
}

// The w4a16 plans: JaxW4a4W4a16MTiles writes the instantiated m_tiles options and returns their count;
// JaxW4a4W4a16Plan writes one solved plan (form: W4a16Form, 0 wide, 1 whole-SM, 2 narrow, 3 narrow32, 4 whole7): block_m, ctas_per_sm,
// max_warps, stage_atoms, tiles_per_warp, block_rows, stages, stage_weight, stage_x, stage_scale, stage, ring, barriers,
// cluster_sums, total, per_sm, lane_sums, fits (18 values); JaxW4a4W4a16Launch writes the launch plan of one problem (-1s: not served): m_tiles,
// m_blocks, warps, n_tiles, splits, form, k_lanes, lane_atoms, k_phases, threads, arrival_counters (11 values).
__attribute__((visibility("default"))) int JaxW4a4W4a16MTiles(int64_t* out) {
  int n = 0;
  for (int m_tiles : jax_w4a4::sm90::w4a16::kMTileOptions) out[n++] = m_tiles;
  return n;
}

__attribute__((visibility("default"))) void JaxW4a4W4a16Plan(int m_tiles, int form, int64_t* out) {
  namespace w4a16 = jax_w4a4::sm90::w4a16;
  const W4a16Plan p = w4a16::SolveW4a16Plan(m_tiles, static_cast<w4a16::W4a16Form>(form));
  const int64_t values[] = {p.block_m,    p.ctas_per_sm, p.max_warps, p.stage_atoms, p.tiles_per_warp, p.block_rows,
                            p.stages,     p.stage_weight_bytes,
                            p.stage_x_bytes, p.stage_scale_bytes, p.stage_bytes, p.ring_bytes, p.barrier_bytes,
                            p.cluster_sum_bytes, p.total_bytes, p.per_sm_bytes, p.lane_sum_bytes, p.fits() ? 1 : 0};
  for (int64_t v : values) *out++ = v;
}

__attribute__((visibility("default"))) void JaxW4a4W4a16Launch(int64_t m, int64_t n, int64_t k, int64_t group_size,
                                                              int act_order, int num_sms, int64_t* out) {
  namespace w4a16 = jax_w4a4::sm90::w4a16;
  const w4a16::W4a16Problem problem{m, n, k, group_size, act_order != 0};
  if (!w4a16::W4a16ShapeSupported(problem) || num_sms < 1) {
    for (int i = 0; i < 11; ++i) out[i] = -1;
    return;
  }
  const w4a16::W4a16Launch l = w4a16::PlanW4a16Launch(problem, num_sms);
  const int64_t values[] = {l.m_tiles,  l.m_blocks,   l.warps,      l.n_tiles, l.splits, static_cast<int64_t>(l.form),
                            l.k_lanes, l.lane_atoms, l.k_phases, w4a16::W4a16LaunchThreads(l),
                            w4a16::W4a16ArrivalCounters(l)};
  for (int64_t v : values) *out++ = v;
}

// The atoms a K split of a w4a16 launch of `form` (W4a16Form) comes in whole runs of (SplitGranule).
__attribute__((visibility("default"))) int JaxW4a4W4a16SplitGranule(int form) {
  return static_cast<int>(jax_w4a4::sm90::w4a16::SplitGranule(static_cast<jax_w4a4::sm90::w4a16::W4a16Form>(form)));
}

// Workspace bytes of one w4a16 launch planned for num_sms SMs (-1: shape not served): the FFI lowering
// sizes the op's workspace result with it (jax_w4a4/ops/primitives.py).
__attribute__((visibility("default"))) int64_t JaxW4a4W4a16WorkspaceBytes(int64_t m, int64_t n, int64_t k,
                                                                          int64_t group_size, int act_order,
                                                                          int num_sms) {
  return jax_w4a4::sm90::w4a16::W4a16WorkspaceBytes({m, n, k, group_size, act_order != 0}, num_sms);
}

// The act_quant launch plan for num_sms SMs: block_rows, rank_cap, row_blocks, k_splits, arrival_counters,
// workspace (6 values); the FFI lowering sizes the op's workspace result with the last.
__attribute__((visibility("default"))) void JaxW4a4ActQuantLaunch(int64_t rows, int64_t k, int64_t rank, int num_sms,
                                                                  int64_t* out) {
  const jax_w4a4::sm90::ActQuantLaunch l = jax_w4a4::sm90::PlanActQuantLaunch(rows, k, rank, num_sms);
  const int64_t values[] = {l.shape.block_rows, l.shape.rank_cap,     l.row_blocks,
                            l.k_splits,         l.arrival_counters, l.workspace_bytes};
  for (int64_t v : values) *out++ = v;
}

// The arrival-counter pool of each kernel (common/arrival_counters.h): counters, the largest num_sms.
__attribute__((visibility("default"))) void JaxW4a4ArrivalCounterLimits(int64_t* out) {
  const int64_t values[] = {jax_w4a4::kArrivalCounters, jax_w4a4::kMaxNumSms};
  for (int64_t v : values) *out++ = v;
}

// Tokens from which w4a4_gemm runs on expanded weights (w4a4_gemm_plan.h).
__attribute__((visibility("default"))) int64_t JaxW4a4W4A4ExpandedWeightsMinTokens() {
  return jax_w4a4::sm90::kW4A4ExpandedWeightsMinTokens;
}

// The instance one w4a4_gemm launch planned for num_sms SMs runs (W4A4LaunchShapeIndex): tile_m, cluster,
// expanded_weights (3 values).
__attribute__((visibility("default"))) void JaxW4a4W4A4LaunchTile(int64_t m, int64_t n, int num_sms, int fp8,
                                                                  int64_t* out) {
  const jax_w4a4::sm90::W4A4Shape& s =
      jax_w4a4::sm90::kW4A4Shapes[jax_w4a4::sm90::W4A4LaunchShapeIndex(m, n, num_sms, fp8 != 0)];
  const int64_t values[] = {s.tile_m, s.cluster, s.expanded_weights ? 1 : 0};
  for (int64_t v : values) *out++ = v;
}

// Workspace bytes of one w4a4_gemm launch planned for num_sms SMs (expanded weights, stream-K partials or 0).
__attribute__((visibility("default"))) int64_t JaxW4a4W4a4WorkspaceBytes(int64_t m, int64_t n, int64_t k,
                                                                        int num_sms) {
  return jax_w4a4::sm90::W4A4WorkspaceBytes(m, n, k, num_sms);
}

}  // extern "C"
