// Shared-memory budgets solved at compile time. Host-compilable (no CUDA headers), so the same
// constexpr plans are static_assert'ed inside the kernels and printed / unit-tested from Python
// through the host-only libjax_w4a4_budget.so (csrc/common/budget_table.cc).
//
// Why this is code and not arithmetic in comments: accounting errors show up as slowness (a pipeline
// squeezed to one stage), never as a failing smoke test. Every object a kernel keeps in shared memory
// is one SmemObject row; its footprint, the bytes each CTA issues, and the bytes a stage's "full"
// barrier expects are derived here, once, with the Hopper cluster rules:
//
//   TMA multicast on Hopper (sm_90): every CTA of the cluster receives the WHOLE tile into its own
//   shared memory, so the footprint is REPLICATED (not divided by the cluster size); the copy is
//   ISSUED in slices, each CTA issuing 1/cluster of the bytes with a multicast mask; and each CTA's
//   barrier must expect the FULL byte count, since all slices land in every CTA.
//   (Blackwell's 2-CTA MMA splits the footprint itself; that rule does not apply here.)
#pragma once

#include <cstdint>

namespace jax_w4a4::budget {

// Opt-in dynamic shared memory per block on sm_90 (227 KB); 1 KB of the SM's 228 KB is reserved per CTA.
inline constexpr int64_t kSmemPerBlockSm90 = 227 * 1024;
inline constexpr int64_t kSmemPerSmSm90 = 228 * 1024;
inline constexpr int64_t kSmemReservedPerCtaSm90 = 1024;
inline constexpr int64_t kMbarrierBytes = 8;
// Region alignment: a TMA destination with 128-byte swizzle (a wgmma operand) needs 1024 bytes; any other
// TMA / bulk-copy destination 128 (16 is legal, 128 keeps every row on its own bank window).
inline constexpr int64_t kSwizzledAlign = 1024;
inline constexpr int64_t kBulkAlign = 128;
// Region alignment inside an XLA-allocated kernel workspace (flags, counters, partials).
inline constexpr int64_t kWorkspaceAlign = 256;

// Registers per thread that __launch_bounds__(threads, ctas_per_sm) leaves ptxas (allocation granule 8,
// at most 255): a CTA owns threads x this for its lifetime (setmaxnreg only moves registers inside it).
inline constexpr int64_t kRegistersPerSmSm90 = 64 * 1024;
constexpr int LaunchRegisters(int64_t threads, int64_t ctas_per_sm) {
  const int64_t r = kRegistersPerSmSm90 / (threads * ctas_per_sm) / 8 * 8;
  return r > 255 ? 255 : static_cast<int>(r);
}

// Registers per thread the computing warps of such a CTA may take (setmaxnreg.inc) once its producer warpgroup of
// `producer_threads` has given its own down to `producer_registers` (setmaxnreg.dec): the rest of the launch pool.
constexpr int ComputeRegistersBesideProducer(int64_t threads, int64_t ctas_per_sm, int64_t producer_threads,
                                             int producer_registers) {
  return static_cast<int>((LaunchRegisters(threads, ctas_per_sm) * threads - producer_registers * producer_threads) /
                          (threads - producer_threads) / 8 * 8);
}

enum class Sharing : int {
  kPrivate = 0,    // loaded by this CTA for itself
  kMulticast = 1,  // the cluster shares it: footprint replicated, issue split, barrier expects all
};

enum class Lifetime : int {
  kMainLoop = 0,   // one buffer per main K-stage, recycled every stage
  kLowRank = 1,    // one buffer per low-rank prefetch stage, recycled per output tile
  kEpilogue = 2,   // staging of the output tile for the store pipeline
  kKernel = 3,     // lives for the whole persistent kernel (barriers, per-column vectors)
};

constexpr int64_t AlignUp(int64_t bytes, int64_t align) { return (bytes + align - 1) / align * align; }

struct SmemObject {
  const char* name;
  int64_t bytes;      // one buffer (one stage) of this object, the whole tile
  int stages;         // buffers kept resident
  Sharing sharing;
  Lifetime lifetime;
  int64_t align;      // of each buffer: kSwizzledAlign or kBulkAlign

  // Bytes this object occupies in EACH CTA's shared memory: replicated under multicast.
  constexpr int64_t footprint() const { return AlignUp(bytes, align) * stages; }
  // Bytes of one buffer that ONE CTA issues: multicast splits the issue over the cluster.
  constexpr int64_t issued_bytes(int cluster) const {
    return sharing == Sharing::kMulticast ? bytes / cluster : bytes;
  }
  // Bytes of one buffer that a CTA's "full" barrier expects to arrive: always the whole tile.
  constexpr int64_t expected_tx_bytes() const { return bytes; }
};

}  // namespace jax_w4a4::budget
