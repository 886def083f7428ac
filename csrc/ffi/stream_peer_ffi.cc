// XLA FFI handler of jax_w4a4_stream_peer (benchmarks only, not an op of the package): the high byte of
// every 16-bit value of x (kernels/stream_peer.cu), so the act_quant benchmark can show what a plain kernel
// moving the same bytes reaches in the same run.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/ffi_util.h"
#include "kernels/stream_peer.h"

namespace jax_w4a4 {
namespace {

ffi::Error StreamPeer(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::U8>> out) {
  if (!IsHalf(x.element_type())) return Invalid("stream_peer", "x must be bfloat16 or float16");
  const int64_t values = static_cast<int64_t>(x.element_count());
  if (static_cast<int64_t>(out->element_count()) != values) {
    return Invalid("stream_peer", "the result must hold one byte per value of x");
  }
  if (values % kStreamPeerValueGranule != 0) {
    return Invalid("stream_peer", "x must hold a multiple of " + std::to_string(kStreamPeerValueGranule) + " values");
  }
  return CudaStatus(LaunchStreamPeer(x.untyped_data(), out->typed_data(), values, stream), "stream_peer launch");
}

}  // namespace
}  // namespace jax_w4a4

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JaxW4a4StreamPeer(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxW4a4StreamPeer, jax_w4a4::StreamPeer,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()                 // x: bf16 / fp16
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>(),     // the high byte of each value
                              {xla::ffi::Traits::kCmdBufferCompatible});
