// Launcher of the W4A16 decode GEMM (w4a16_gemm.cu). Buffer contract: docs/layouts.md, section
// w4a16_gemm, with qweight in the prepacked layout of jax_w4a4/formats/w4a16_layout.py. The FFI handler
// (csrc/ffi/w4a16_gemm_ffi.cc) validates shapes and dtypes before calling in here.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/sm90/w4a16_gemm_plan.h"

namespace jax_w4a4::sm90::w4a16 {

enum class Dtype { kBf16, kFp16 };

struct GemmArgs {
  const void* x;          // (m, k) bf16/fp16
  const int32_t* qweight;  // prepacked (n / 16 + 1, 2 k) int32
  const void* scales;     // (k / group_size, n) x dtype: the kernel layout (w4a16_layout.prepack_scales)
  const uint8_t* zeros;   // (k / group_size, n) uint8, or nullptr (symmetric, z = 8)
  const int32_t* g_idx;   // (k,) int32 act-order groups, or nullptr
  const void* bias;       // (n,) x dtype, or nullptr
  void* y;                // (m, n) x dtype
  int64_t m;
  int64_t n;
  int64_t k;
  int64_t group_size;     // 32, 64, 128 or k (per channel)
  Dtype dtype;
};

inline W4a16Problem ProblemOf(const GemmArgs& args) {
  return {args.m, args.n, args.k, args.group_size, args.g_idx != nullptr};
}

// Enqueues the work on `stream`: no host sync, no allocation, CUDA-graph safe. The launch is planned
// for `num_sms` SMs (PlanW4a16Launch); `workspace` holds at least W4a16WorkspaceBytes(ProblemOf(args),
// num_sms) bytes (uninitialised; nothing in it needs zeroing). Returns cudaErrorInvalidValue for shapes
// outside W4a16ShapeSupported, num_sms outside [1, kMaxNumSms] or a too small workspace, otherwise the
// launch status.
cudaError_t LaunchGemm(const GemmArgs& args, void* workspace, size_t workspace_bytes, int num_sms,
                       cudaStream_t stream);

// The nonzero counters of this kernel's arrival-counter pool (common/arrival_counters.h: every launch
// must leave them at 0), or -1 when unreadable. Synchronizes the current device; for tests.
int64_t W4a16ArmedCounters();

}  // namespace jax_w4a4::sm90::w4a16
