// Launcher of the fused activation-quantization kernel (act_quant.cu). The byte contract of every
// buffer is docs/layouts.md, section act_quant; the FFI handler (csrc/ffi/act_quant_ffi.cc) validates
// shapes and dtypes before calling in here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_w4a4::sm90 {

enum class HalfType { kBf16, kFp16 };
inline constexpr int64_t kActQuantMaxK = int64_t{1} << 22;
enum class ActFormat { kInt4, kUint4, kFp8 };

struct ActQuantArgs {
  const void* x;          // (rows, k) bf16/fp16
  const float* smooth;    // (k,) fp32, lambda
  const void* lora_down;  // (k, rank) x dtype; unused when rank == 0
  void* q;                // uint8 (rows, k): one float8_e4m3fn code per value, every format
  void* scales;           // (rows, k/64) x dtype or (rows, k/128) fp32
  float* la;              // (rows, rank) fp32; unused when rank == 0
  void* workspace;        // ActQuantWorkspaceBytes(rows, k, rank, num_sms) bytes (act_quant_plan.h), or none if 0
  int64_t workspace_bytes;
  int64_t rows;
  int64_t k;
  int64_t rank;
  int num_sms;            // the SM count the launch is planned for (the one the workspace was sized with)
  // The W4A4 linear: every CTA adds 1 to this counter (release, GPU scope) once its codes and scales are
  // stored; the GEMM launched next waits for all of them and re-arms it (w4a4_gemm.h, act_quant_ctas).
  uint32_t* tokens_ready = nullptr;
  // The W4A4 linear: the W4A4 GEMM's promotion records, (rows, k/64) x (scale, offset term) fp32
  // (w4a4_gemm_plan.h, W4A4PromotionRecordsBytes), stored with the codes (before the tokens_ready arrival);
  // nullptr: none. Only where ActQuantWritesPromotionRecords (the launch plan's 16-row blocks); elsewhere the
  // launch fails with cudaErrorInvalidValue.
  float2* promotion_records = nullptr;
  HalfType dtype;
  ActFormat format;
};

// Enqueues the kernel on `stream` (no host sync, no allocation, CUDA-graph safe). Returns
// cudaErrorInvalidValue for shapes outside the kernel's contract (rows < 2^31, k % 64 for int4/uint4,
// k % 128 for fp8, k <= kActQuantMaxK, rank % 16 == 0 and <= 256, num_sms in [1, kMaxNumSms], x 16-byte
// aligned) or a workspace smaller than ActQuantWorkspaceBytes, otherwise the launch status.
cudaError_t LaunchActQuant(const ActQuantArgs& args, cudaStream_t stream);

// The nonzero counters of this kernel's arrival-counter pool (common/arrival_counters.h: every launch
// must leave them at 0), or -1 when unreadable. Synchronizes the current device; for tests.
int64_t ActQuantArmedCounters();

}  // namespace jax_w4a4::sm90
