// XLA FFI handler of jax_w4a4_w4a16_gemm: decode the buffers, validate them against docs/layouts.md
// (section w4a16_gemm; qweight in the prepacked layout of jax_w4a4/formats/w4a16_layout.py), launch. The
// split-K / act-order workspace is a second result that XLA allocates (the lowering sizes it with
// W4a16WorkspaceBytes for the `num_sms` it plans for) and the split-K arrival counters are the library's
// own (common/arrival_counters.h), so the call needs no memset and can be captured in a CUDA graph.
// The math lives in csrc/kernels/sm90/w4a16_gemm.cu.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/ffi_util.h"
#include "ffi/handler_util.h"
#include "kernels/sm90/w4a16_gemm.h"

namespace jax_w4a4 {
namespace {

namespace w4a16 = sm90::w4a16;

constexpr std::string_view kOp = "w4a16_gemm";

bool IsEmpty(const ffi::AnyBuffer& buffer) {
  auto dims = buffer.dimensions();
  return dims.size() == 1 && dims[0] == 0;
}

bool ShapeIs(const ffi::AnyBuffer& buffer, std::initializer_list<int64_t> expected) {
  auto dims = buffer.dimensions();
  if (dims.size() != expected.size()) return false;
  size_t i = 0;
  for (int64_t d : expected) {
    if (dims[i++] != d) return false;
  }
  return true;
}

ffi::Error W4a16GemmImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer qweight, ffi::AnyBuffer scales,
                         ffi::AnyBuffer zeros, ffi::AnyBuffer g_idx, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> workspace, int64_t group_size, int64_t num_sms) {
  const ffi::DataType dtype = x.element_type();
  if (!IsHalf(dtype)) return Invalid(kOp, "x must be bf16 or fp16");
  if (x.dimensions().size() < 1) return Invalid(kOp, "x must be at least 1-D");
  const int64_t m = LeadingRows(x);
  const int64_t k = LastDim(x);
  if (scales.dimensions().size() != 2 || scales.element_type() != dtype) {
    return Invalid(kOp, "scales must be 2-D (K/G, N) in x's dtype (the kernel layout), got " + DimsString(scales));
  }
  const int64_t groups = scales.dimensions()[0];
  const int64_t n = scales.dimensions()[1];
  if (group_size <= 0 || k % group_size != 0 || groups != k / group_size) {
    return Invalid(kOp, "scales " + DimsString(scales) + " do not match K=" + std::to_string(k) +
                            " and group_size=" + std::to_string(group_size));
  }
  if (qweight.element_type() != ffi::DataType::S32 || n % 16 != 0 || !ShapeIs(qweight, {n / 16 + 1, 2 * k})) {
    return Invalid(kOp, "qweight must be the int32 prepacked layout (N/16 + 1, 2K) = (" +
                            std::to_string(n / 16 + 1) + ", " + std::to_string(2 * k) + "), got " +
                            DimsString(qweight));
  }
  const bool has_zeros = !IsEmpty(zeros);
  if (has_zeros && (zeros.element_type() != ffi::DataType::U8 || !ShapeIs(zeros, {groups, n}))) {
    return Invalid(kOp, "zeros must be uint8 (K/G, N) or (0,), got " + DimsString(zeros));
  }
  const bool has_g_idx = !IsEmpty(g_idx);
  if (has_g_idx && (g_idx.element_type() != ffi::DataType::S32 || !ShapeIs(g_idx, {k}))) {
    return Invalid(kOp, "g_idx must be int32 (K,) or (0,), got " + DimsString(g_idx));
  }
  const bool has_bias = !IsEmpty(bias);
  if (has_bias && (bias.element_type() != dtype || !ShapeIs(bias, {n}))) {
    return Invalid(kOp, "bias must be (N,) in x's dtype or (0,), got " + DimsString(bias));
  }
  auto x_dims = x.dimensions();
  auto y_dims = y->dimensions();
  bool y_ok = y->element_type() == dtype && y_dims.size() == x_dims.size() && LastDim(*y) == n;
  for (size_t i = 0; y_ok && i + 1 < x_dims.size(); ++i) y_ok = y_dims[i] == x_dims[i];
  if (!y_ok) return Invalid(kOp, "y must be x.shape[:-1] + (N,) in x's dtype, got " + DimsString(*y));
  if (m == 0) return ffi::Error::Success();

  w4a16::GemmArgs args{};
  args.x = x.untyped_data();
  args.qweight = static_cast<const int32_t*>(qweight.untyped_data());
  args.scales = scales.untyped_data();
  args.zeros = has_zeros ? static_cast<const uint8_t*>(zeros.untyped_data()) : nullptr;
  args.g_idx = has_g_idx ? static_cast<const int32_t*>(g_idx.untyped_data()) : nullptr;
  args.bias = has_bias ? bias.untyped_data() : nullptr;
  args.y = y->untyped_data();
  args.m = m;
  args.n = n;
  args.k = k;
  args.group_size = group_size;
  args.dtype = dtype == ffi::DataType::F16 ? w4a16::Dtype::kFp16 : w4a16::Dtype::kBf16;
  const w4a16::W4a16Problem problem = w4a16::ProblemOf(args);
  if (!w4a16::W4a16ShapeSupported(problem)) {
    return Invalid(kOp, "the CUDA kernel needs N % 32 == 0, K % 64 == 0 and group_size in {32, 64, 128, K}; got N=" +
                            std::to_string(n) + ", K=" + std::to_string(k) +
                            ", group_size=" + std::to_string(group_size));
  }

  JAX_W4A4_RETURN_IF_ERROR(CheckNumSms(kOp, num_sms));
  JAX_W4A4_RETURN_IF_ERROR(
      CheckWorkspace(kOp, *workspace, w4a16::W4a16WorkspaceBytes(problem, static_cast<int>(num_sms))));
  return CudaStatus(w4a16::LaunchGemm(args, workspace->untyped_data(), workspace->size_bytes(),
                                      static_cast<int>(num_sms), stream),
                    "w4a16_gemm launch");
}

}  // namespace
}  // namespace jax_w4a4

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JaxW4a4W4a16Gemm(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxW4a4W4a16Gemm, jax_w4a4::W4a16GemmImpl,
                              jax_w4a4::ffi::Ffi::Bind()
                                  .Ctx<jax_w4a4::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<jax_w4a4::ffi::AnyBuffer>()  // x
                                  .Arg<jax_w4a4::ffi::AnyBuffer>()  // qweight (prepacked)
                                  .Arg<jax_w4a4::ffi::AnyBuffer>()  // scales
                                  .Arg<jax_w4a4::ffi::AnyBuffer>()  // zeros or (0,)
                                  .Arg<jax_w4a4::ffi::AnyBuffer>()  // g_idx or (0,)
                                  .Arg<jax_w4a4::ffi::AnyBuffer>()  // bias or (0,)
                                  .Ret<jax_w4a4::ffi::AnyBuffer>()  // y
                                  .Ret<jax_w4a4::ffi::AnyBuffer>()  // workspace (uint8)
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("num_sms"),
                              {jax_w4a4::ffi::Traits::kCmdBufferCompatible});  // no host sync, no allocation
