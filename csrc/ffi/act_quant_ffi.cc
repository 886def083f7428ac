// XLA FFI handler of `jax_w4a4_act_quant` (docs/layouts.md, act_quant): decode the buffers, check
// them against the layout contract, launch csrc/kernels/sm90/act_quant.cu on XLA's stream. The K split's
// workspace is a fourth result that XLA allocates (the lowering sizes it with ActQuantWorkspaceBytes for
// the `num_sms` it plans for) and its arrival counters are the library's own (common/arrival_counters.h),
// so the call needs no memset and can be captured in a CUDA graph.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "common/ffi_util.h"
#include "ffi/handler_util.h"
#include "ffi/w4a4_handlers.h"
#include "kernels/sm90/act_quant.h"
#include "kernels/sm90/act_quant_plan.h"
#include "xla/ffi/api/ffi.h"

namespace jax_w4a4 {
namespace {

constexpr std::string_view kOp = "act_quant";

}  // namespace

ffi::Error ActQuantArgsFrom(ffi::AnyBuffer x, ffi::AnyBuffer smooth, ffi::AnyBuffer lora_down, ffi::AnyBuffer q,
                            ffi::AnyBuffer scales, ffi::AnyBuffer la, ffi::AnyBuffer workspace,
                            std::string_view act_format, int64_t num_sms, sm90::ActQuantArgs& args) {
  sm90::ActFormat format;
  if (!ParseActFormat(act_format, format)) {
    return Invalid(kOp, "act_format must be \"int4\", \"uint4\" or \"fp8\", got \"" + std::string(act_format) + "\"");
  }
  const bool fp8 = format == sm90::ActFormat::kFp8;
  if (!IsHalf(x.element_type()) || x.dimensions().size() < 1) {
    return Invalid(kOp, "x must be bf16 or fp16 of shape (..., K), got " + DimsString(x));
  }
  const int64_t k = LastDim(x);
  const int64_t rows = LeadingRows(x);
  const int64_t group = fp8 ? 128 : 64;
  if (k <= 0 || k % group != 0 || k > sm90::kActQuantMaxK) {
    return Invalid(kOp, "K = " + std::to_string(k) + " must be a positive multiple of " + std::to_string(group) +
                            " (at most 2^22) for act_format " + std::string(act_format));
  }
  if (smooth.element_type() != ffi::DataType::F32 || smooth.dimensions().size() != 1 ||
      smooth.dimensions()[0] != k) {
    return Invalid(kOp, "smooth must be fp32 (K,) = (" + std::to_string(k) + ",), got " + DimsString(smooth));
  }
  auto l_dims = lora_down.dimensions();
  if (lora_down.element_type() != x.element_type() || l_dims.size() != 2 || l_dims[0] != k) {
    return Invalid(kOp, "lora_down must be (K, r) = (" + std::to_string(k) + ", r) in x's dtype, got " +
                            DimsString(lora_down));
  }
  const int64_t rank = l_dims[1];
  if (rank % 16 != 0 || rank > 256) {
    return Invalid(kOp, "rank r = " + std::to_string(rank) + " must be a multiple of 16 in [0, 256]");
  }
  // One e4m3 code per value for every format.
  JAX_W4A4_RETURN_IF_ERROR(CheckActivationLike(kOp, q, x, "x", k, ffi::DataType::U8, "q"));
  JAX_W4A4_RETURN_IF_ERROR(
      CheckActivationLike(kOp, scales, x, "x", k / group, fp8 ? ffi::DataType::F32 : x.element_type(), "scales"));
  JAX_W4A4_RETURN_IF_ERROR(CheckActivationLike(kOp, la, x, "x", rank, ffi::DataType::F32, "la"));
  JAX_W4A4_RETURN_IF_ERROR(CheckNumSms(kOp, num_sms));
  JAX_W4A4_RETURN_IF_ERROR(
      CheckWorkspace(kOp, workspace, sm90::ActQuantWorkspaceBytes(rows, k, rank, static_cast<int>(num_sms))));
  args.x = x.untyped_data();
  args.smooth = static_cast<const float*>(smooth.untyped_data());
  args.lora_down = lora_down.untyped_data();
  args.q = q.untyped_data();
  args.scales = scales.untyped_data();
  args.la = static_cast<float*>(la.untyped_data());
  args.workspace = workspace.untyped_data();
  args.workspace_bytes = static_cast<int64_t>(workspace.size_bytes());
  args.rows = rows;
  args.k = k;
  args.rank = rank;
  args.num_sms = static_cast<int>(num_sms);
  args.dtype = x.element_type() == ffi::DataType::BF16 ? sm90::HalfType::kBf16 : sm90::HalfType::kFp16;
  args.format = format;
  return ffi::Error::Success();
}

namespace {

ffi::Error ActQuant(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer smooth, ffi::AnyBuffer lora_down,
                    ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> scales,
                    ffi::Result<ffi::AnyBuffer> la, ffi::Result<ffi::AnyBuffer> workspace,
                    std::string_view act_format, int64_t num_sms) {
  sm90::ActQuantArgs args;
  JAX_W4A4_RETURN_IF_ERROR(
      ActQuantArgsFrom(x, smooth, lora_down, *q, *scales, *la, *workspace, act_format, num_sms, args));
  if (args.rows == 0) return ffi::Error::Success();
  return CudaStatus(sm90::LaunchActQuant(args, stream), "act_quant launch");
}

}  // namespace
}  // namespace jax_w4a4

// Exported (the library builds with hidden visibility).
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JaxW4a4ActQuant(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxW4a4ActQuant, jax_w4a4::ActQuant,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // smooth
                                  .Arg<xla::ffi::AnyBuffer>()  // lora_down
                                  .Ret<xla::ffi::AnyBuffer>()  // q
                                  .Ret<xla::ffi::AnyBuffer>()  // scales
                                  .Ret<xla::ffi::AnyBuffer>()  // la
                                  .Ret<xla::ffi::AnyBuffer>()  // workspace (uint8)
                                  .Attr<std::string_view>("act_format")
                                  .Attr<int64_t>("num_sms"),
                              {xla::ffi::Traits::kCmdBufferCompatible});  // no host sync, no allocation
