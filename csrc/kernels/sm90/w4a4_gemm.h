// Launcher of the warp-specialized persistent W4A4 GEMM with the fused low-rank branch (w4a4_gemm.cu),
// the production sm_90a kernel. The byte contract of every buffer is docs/layouts.md, section w4a4_gemm,
// except the weights, which come prepacked (jax_w4a4/formats/svdq_layout.py). The FFI handler
// (csrc/ffi/w4a4_gemm_ffi.cc) validates shapes and dtypes before calling in here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

// HalfType and ActFormat are shared with act_quant, whose outputs this GEMM consumes.
#include "kernels/sm90/act_quant.h"

namespace jax_w4a4::sm90 {

struct W4A4GemmSm90Args {
  const uint8_t* q_x;      // (m, k) e4m3 codes, every act_format (int4/uint4 values are integers)
  const void* s_x;         // (m, k/64) out dtype (int4/uint4) or (m, k/128) fp32 (fp8)
  const float* la;         // (m, rank) fp32; unused when rank == 0
  const uint8_t* qweight;  // prepacked (n/64, k/64, 2048) uint8: formats/svdq_layout.py
  const void* wscales;     // prepacked stage-major (k/128, n, 2) out dtype: formats/svdq_layout.py
  const void* lora_up;     // (rank, n) out dtype; unused when rank == 0
  const float* alpha;      // (n,) fp32 or nullptr
  const void* bias;        // (n,) out dtype or nullptr
  void* y;                 // (m, n) out dtype
  int64_t m;
  int64_t n;
  int64_t k;
  int64_t rank;
  HalfType out_type;
  ActFormat act_format;
  // Stream-K workspace (w4a4_gemm_plan.h, W4A4WorkspaceBytes planned for num_sms CTAs); with fewer bytes
  // than the launch needs, whole tiles run in rounds instead.
  void* workspace;
  int64_t workspace_bytes;
  int num_sms;
  // Launched right after act_quant (which wrote q_x, s_x and la) in the same stream: programmatic dependent
  // launch, so the CTAs start and set up while act_quant runs (not for expanded weights, whose expansion
  // kernel runs in between).
  bool after_act_quant = false;
  // In the W4A4 linear: act_quant's CTA count. Each of them arrives at W4A4GemmTokensReadyCounter() once its
  // codes and scales are stored (ActQuantArgs::tokens_ready), and the GEMM loads the tokens when all have,
  // not when act_quant ends; its last CTA re-arms the counter. 0: the tokens are ready when act_quant ends.
  // Decode tiles take it only with promotion_records_written (else the launch fails: cudaErrorInvalidValue).
  uint32_t act_quant_ctas = 0;
  // Decode tiles (w4a4_gemm_plan.h, W4A4PromotionRecordsBytes): the tokens' promotion records in the workspace
  // (at W4A4PromotionRecordsOffset). In the W4A4 linear act_quant writes them (ActQuantArgs::promotion_records);
  // otherwise the launcher forms them from q_x and s_x first (PromotionRecordsKernel) and launches the GEMM after
  // it as after act_quant.
  bool promotion_records_written = false;
};

// The shapes the kernel serves: n and k positive multiples of 128, rank a multiple of 16 in [0, 256],
// 0 <= m < 2^31 (m == 0 launches nothing). Returns nullptr when served, else the violated rule.
const char* CheckW4A4GemmSm90Shape(int64_t m, int64_t n, int64_t k, int64_t rank);

// Enqueues the kernel on `stream`: no host sync, no allocation, no memset, CUDA-graph safe (the TMA
// descriptors are encoded on the host for every call and passed as kernel parameters). Returns
// cudaErrorInvalidValue for a shape outside CheckW4A4GemmSm90Shape, a pointer that is not 16-byte
// aligned, or num_sms outside [1, kMaxNumSms], otherwise the launch status.
cudaError_t LaunchW4A4GemmSm90(const W4A4GemmSm90Args& args, cudaStream_t stream);

// The nonzero counters of this kernel's arrival-counter pool (common/arrival_counters.h: every launch
// must leave them at 0), or -1 when unreadable. Synchronizes the current device; for tests.
int64_t W4A4GemmArmedCounters();

// The token-ready counter of this kernel's pool on the current device (act_quant_ctas above), or nullptr with
// the CUDA error in `status`.
uint32_t* W4A4GemmTokensReadyCounter(cudaError_t& status);

}  // namespace jax_w4a4::sm90
