// XLA FFI handler of `jax_w4a4_w4a4_linear` (docs/layouts.md, w4a4_linear): the whole W4A4 layer in one
// custom call, act_quant then the W4A4 GEMM on XLA's stream, each decoded and checked as in its own handler.
// One call, so that the GEMM can be launched with programmatic dependent launch: its CTAs start and set up
// while act_quant runs, and load the tokens once act_quant's CTAs have stored them, before its LA split sum
// ends (w4a4_gemm.cu, WaitForTokens). As two custom calls this overlap is lost: XLA
// records each custom call of a command buffer as its own nested graph, and no programmatic edge joins two
// of them (benchmarks/NOTES.md, sessions 29 and 44). Act_quant's outputs and both workspaces are results
// that XLA allocates and the lowering drops, so the call needs no allocation and stays CUDA-graph safe.
#include <cuda_runtime.h>

#include <cstdint>
#include <string_view>

#include "common/ffi_util.h"
#include "ffi/handler_util.h"
#include "ffi/w4a4_handlers.h"
#include "kernels/sm90/act_quant.h"
#include "kernels/sm90/act_quant_plan.h"
#include "kernels/sm90/w4a4_gemm.h"
#include "kernels/sm90/w4a4_gemm_plan.h"
#include "xla/ffi/api/ffi.h"

namespace jax_w4a4 {
namespace {

ffi::Error W4a4Linear(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer smooth, ffi::AnyBuffer lora_down,
                      ffi::AnyBuffer qweight, ffi::AnyBuffer wscales, ffi::AnyBuffer lora_up, ffi::AnyBuffer alpha,
                      ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> q_x,
                      ffi::Result<ffi::AnyBuffer> s_x, ffi::Result<ffi::AnyBuffer> la,
                      ffi::Result<ffi::AnyBuffer> act_quant_workspace, ffi::Result<ffi::AnyBuffer> gemm_workspace,
                      std::string_view act_format, int64_t num_sms) {
  sm90::ActQuantArgs quantize;
  JAX_W4A4_RETURN_IF_ERROR(ActQuantArgsFrom(x, smooth, lora_down, *q_x, *s_x, *la, *act_quant_workspace, act_format,
                                            num_sms, quantize));
  sm90::W4A4GemmSm90Args gemm;
  JAX_W4A4_RETURN_IF_ERROR(W4a4GemmArgsFrom(*q_x, *s_x, *la, qweight, wscales, lora_up, alpha, bias, *y,
                                            *gemm_workspace, act_format, num_sms, gemm));
  if (gemm.m == 0) return ffi::Error::Success();
  const sm90::ActQuantLaunch plan = sm90::PlanActQuantLaunch(quantize.rows, quantize.k, quantize.rank, quantize.num_sms);
  // Decode tiles: act_quant writes the GEMM's promotion records into the GEMM's workspace with the codes (where
  // its plan can: else the GEMM forms them from the codes and scales itself, in a kernel after act_quant).
  const bool needs_records = sm90::W4A4PromotionRecordsBytes(gemm.m, gemm.k) > 0;
  if (needs_records && sm90::ActQuantWritesPromotionRecords(plan)) {
    quantize.promotion_records = reinterpret_cast<float2*>(
        static_cast<uint8_t*>(gemm.workspace) + sm90::W4A4PromotionRecordsOffset(gemm.m, gemm.n, gemm.k, gemm.num_sms));
    gemm.promotion_records_written = true;
  }
  // The token handoff: act_quant's CTAs arrive at the counter once their codes are stored, and the GEMM loads
  // them then. Not when the GEMM forms the records after act_quant (a 64-row plan at decode, on few SMs): its
  // loads must wait for that kernel's end.
  if (!needs_records || gemm.promotion_records_written) {
    cudaError_t counter_status = cudaSuccess;
    quantize.tokens_ready = sm90::W4A4GemmTokensReadyCounter(counter_status);
    JAX_W4A4_RETURN_IF_ERROR(CudaStatus(counter_status, "w4a4_linear token-ready counter"));
    gemm.act_quant_ctas = static_cast<uint32_t>(plan.row_blocks * plan.k_splits);
  }
  JAX_W4A4_RETURN_IF_ERROR(CudaStatus(sm90::LaunchActQuant(quantize, stream), "w4a4_linear act_quant launch"));
  gemm.after_act_quant = true;
  const cudaError_t gemm_status = sm90::LaunchW4A4GemmSm90(gemm, stream);
  // Without the GEMM nobody takes act_quant's arrivals: re-arm the counter after act_quant, in stream order.
  if (gemm_status != cudaSuccess && quantize.tokens_ready != nullptr) {
    cudaMemsetAsync(quantize.tokens_ready, 0, sizeof(uint32_t), stream);
  }
  return CudaStatus(gemm_status, "w4a4_linear w4a4_gemm launch");
}

}  // namespace
}  // namespace jax_w4a4

// Exported (the library builds with hidden visibility).
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JaxW4a4W4a4Linear(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxW4a4W4a4Linear, jax_w4a4::W4a4Linear,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // smooth
                                  .Arg<xla::ffi::AnyBuffer>()  // lora_down
                                  .Arg<xla::ffi::AnyBuffer>()  // qweight
                                  .Arg<xla::ffi::AnyBuffer>()  // wscales
                                  .Arg<xla::ffi::AnyBuffer>()  // lora_up
                                  .Arg<xla::ffi::AnyBuffer>()  // alpha
                                  .Arg<xla::ffi::AnyBuffer>()  // bias
                                  .Ret<xla::ffi::AnyBuffer>()  // y
                                  .Ret<xla::ffi::AnyBuffer>()  // q_x (act_quant's codes)
                                  .Ret<xla::ffi::AnyBuffer>()  // s_x (act_quant's scales)
                                  .Ret<xla::ffi::AnyBuffer>()  // la
                                  .Ret<xla::ffi::AnyBuffer>()  // act_quant workspace (uint8)
                                  .Ret<xla::ffi::AnyBuffer>()  // w4a4_gemm workspace (uint8)
                                  .Attr<std::string_view>("act_format")
                                  .Attr<int64_t>("num_sms"),
                              {xla::ffi::Traits::kCmdBufferCompatible});  // no host sync, no allocation
