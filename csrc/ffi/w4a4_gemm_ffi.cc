// XLA FFI handler of `jax_w4a4_w4a4_gemm` (docs/layouts.md, w4a4_gemm): decode the buffers, check them
// against the layout contract and the kernel's shape rules, launch csrc/kernels/sm90/w4a4_gemm.cu on
// XLA's stream. The workspace (stream-K partials, or a long prefill's expanded weights) is a second result
// that XLA allocates (the lowering sizes it with W4A4WorkspaceBytes for the `num_sms` it plans for) and its
// stream-K flags are the library's own (common/arrival_counters.h), so the call needs no memset and can be
// captured in a CUDA graph.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "common/ffi_util.h"
#include "ffi/handler_util.h"
#include "ffi/w4a4_handlers.h"
#include "kernels/sm90/w4a4_gemm.h"
#include "kernels/sm90/w4a4_gemm_plan.h"
#include "xla/ffi/api/ffi.h"

namespace jax_w4a4 {
namespace {

constexpr std::string_view kOp = "w4a4_gemm";
constexpr int64_t kStageK = 128;  // K per row of the prepacked weight scales: two groups of 64
constexpr int64_t kPrepackedBlockBytes = 2048;  // formats/svdq_layout.py: 64 x 64 int4 per block

}  // namespace

ffi::Error W4a4GemmArgsFrom(ffi::AnyBuffer q_x, ffi::AnyBuffer s_x, ffi::AnyBuffer la, ffi::AnyBuffer qweight,
                            ffi::AnyBuffer wscales, ffi::AnyBuffer lora_up, ffi::AnyBuffer alpha, ffi::AnyBuffer bias,
                            ffi::AnyBuffer y, ffi::AnyBuffer workspace, std::string_view act_format, int64_t num_sms,
                            sm90::W4A4GemmSm90Args& args) {
  sm90::ActFormat format;
  if (!ParseActFormat(act_format, format)) {
    return Invalid(kOp, "act_format must be \"int4\", \"uint4\" or \"fp8\", got \"" + std::string(act_format) + "\"");
  }
  const bool fp8 = format == sm90::ActFormat::kFp8;

  // wscales, prepacked stage-major (K/128, N, 2) in the output dtype, gives N and K; qweight is prepacked
  // (N/64, K/64, 2048) uint8.
  const ffi::DataType out_dtype = wscales.element_type();
  auto s_dims = wscales.dimensions();
  if (!IsHalf(out_dtype) || s_dims.size() != 3 || s_dims[2] != 2) {
    return Invalid(kOp, "wscales must be prepacked bf16/fp16 (K/128, N, 2), got " + Describe(wscales));
  }
  const int64_t n = s_dims[1];
  const int64_t k = kStageK * s_dims[0];
  auto w_dims = qweight.dimensions();
  const int64_t n_blocks = (n + 63) / 64, k_blocks = (k + 63) / 64;
  if (qweight.element_type() != ffi::DataType::U8 || w_dims.size() != 3 || w_dims[0] != n_blocks ||
      w_dims[1] != k_blocks || w_dims[2] != kPrepackedBlockBytes) {
    return Invalid(kOp, "qweight must be prepacked uint8 (" + std::to_string(n_blocks) + ", " +
                            std::to_string(k_blocks) + ", 2048), got " + Describe(qweight));
  }

  // Activations: q_x (..., K) e4m3 codes, s_x (..., K/64) out dtype or (..., K/128) fp32 (fp8), la (..., r).
  if (q_x.dimensions().size() < 1) return Invalid(kOp, "q_x must be (..., K) e4m3 codes, got a scalar");
  const int64_t m = LeadingRows(q_x);
  JAX_W4A4_RETURN_IF_ERROR(CheckActivationLike(kOp, q_x, q_x, "q_x", k, ffi::DataType::U8, "q_x"));
  JAX_W4A4_RETURN_IF_ERROR(CheckActivationLike(kOp, s_x, q_x, "q_x", fp8 ? k / 128 : k / 64,
                                               fp8 ? ffi::DataType::F32 : out_dtype, "s_x"));
  auto up_dims = lora_up.dimensions();
  if (lora_up.element_type() != out_dtype || up_dims.size() != 2 || up_dims[1] != n) {
    return Invalid(kOp, "lora_up must be (r, " + std::to_string(n) + ") in wscales' dtype, got " + Describe(lora_up));
  }
  const int64_t rank = up_dims[0];
  JAX_W4A4_RETURN_IF_ERROR(CheckActivationLike(kOp, la, q_x, "q_x", rank, ffi::DataType::F32, "la"));
  const void* alpha_data = nullptr;
  const void* bias_data = nullptr;
  JAX_W4A4_RETURN_IF_ERROR(OptionalVector(kOp, alpha, n, ffi::DataType::F32, "alpha", alpha_data));
  JAX_W4A4_RETURN_IF_ERROR(OptionalVector(kOp, bias, n, out_dtype, "bias", bias_data));
  JAX_W4A4_RETURN_IF_ERROR(CheckActivationLike(kOp, y, q_x, "q_x", n, out_dtype, "y"));

  if (const char* why = sm90::CheckW4A4GemmSm90Shape(m, n, k, rank)) {
    return Invalid(kOp, std::string("unsupported shape M=") + std::to_string(m) + " N=" + std::to_string(n) +
                            " K=" + std::to_string(k) + " r=" + std::to_string(rank) + ": " + why);
  }
  JAX_W4A4_RETURN_IF_ERROR(CheckNumSms(kOp, num_sms));
  JAX_W4A4_RETURN_IF_ERROR(CheckWorkspace(kOp, workspace, sm90::W4A4WorkspaceBytes(m, n, k, num_sms)));
  args = sm90::W4A4GemmSm90Args{
      static_cast<const uint8_t*>(q_x.untyped_data()),
      s_x.untyped_data(),
      static_cast<const float*>(la.untyped_data()),
      static_cast<const uint8_t*>(qweight.untyped_data()),
      wscales.untyped_data(),
      lora_up.untyped_data(),
      static_cast<const float*>(alpha_data),
      bias_data,
      y.untyped_data(),
      m, n, k, rank,
      out_dtype == ffi::DataType::BF16 ? sm90::HalfType::kBf16 : sm90::HalfType::kFp16,
      format,
      workspace.untyped_data(),
      static_cast<int64_t>(workspace.size_bytes()),
      static_cast<int>(num_sms)};
  return ffi::Error::Success();
}

namespace {

ffi::Error W4a4Gemm(cudaStream_t stream, ffi::AnyBuffer q_x, ffi::AnyBuffer s_x, ffi::AnyBuffer la,
                    ffi::AnyBuffer qweight, ffi::AnyBuffer wscales, ffi::AnyBuffer lora_up, ffi::AnyBuffer alpha,
                    ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> workspace,
                    std::string_view act_format, int64_t num_sms) {
  sm90::W4A4GemmSm90Args args;
  JAX_W4A4_RETURN_IF_ERROR(W4a4GemmArgsFrom(q_x, s_x, la, qweight, wscales, lora_up, alpha, bias, *y, *workspace,
                                            act_format, num_sms, args));
  if (args.m == 0) return ffi::Error::Success();
  return CudaStatus(sm90::LaunchW4A4GemmSm90(args, stream), "w4a4_gemm launch");
}

}  // namespace
}  // namespace jax_w4a4

// Exported (the library builds with hidden visibility).
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JaxW4a4W4a4Gemm(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxW4a4W4a4Gemm, jax_w4a4::W4a4Gemm,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // q_x
                                  .Arg<xla::ffi::AnyBuffer>()  // s_x
                                  .Arg<xla::ffi::AnyBuffer>()  // la
                                  .Arg<xla::ffi::AnyBuffer>()  // qweight
                                  .Arg<xla::ffi::AnyBuffer>()  // wscales
                                  .Arg<xla::ffi::AnyBuffer>()  // lora_up
                                  .Arg<xla::ffi::AnyBuffer>()  // alpha
                                  .Arg<xla::ffi::AnyBuffer>()  // bias
                                  .Ret<xla::ffi::AnyBuffer>()  // y
                                  .Ret<xla::ffi::AnyBuffer>()  // workspace (uint8)
                                  .Attr<std::string_view>("act_format")
                                  .Attr<int64_t>("num_sms"),
                              {xla::ffi::Traits::kCmdBufferCompatible});  // no host sync, no allocation
