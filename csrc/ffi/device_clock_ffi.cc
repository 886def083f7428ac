// XLA FFI handler of jax_w4a4_device_clock (benchmarks only, not an op of the package): reads the GPU
// global timer (ns) once its input (a dependency, never read) is ready, as two uint32 words (low, high):
// JAX without x64 has no uint64 arrays.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/ffi_util.h"
#include "kernels/device_clock.h"

namespace jax_w4a4 {
namespace {

ffi::Error DeviceClock(cudaStream_t stream, ffi::AnyBuffer /*after*/, ffi::Result<ffi::Buffer<ffi::U32>> now) {
  if (now->element_count() != 2) return ffi::Error::InvalidArgument("device_clock: the result must be uint32[2]");
  return CudaStatus(LaunchReadGlobalTimer(reinterpret_cast<uint64_t*>(now->typed_data()), stream),
                    "device_clock launch");
}

}  // namespace
}  // namespace jax_w4a4

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JaxW4a4DeviceClock(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxW4a4DeviceClock, jax_w4a4::DeviceClock,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()                     // after: a dependency
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>(),        // now (ns): low, high
                              {xla::ffi::Traits::kCmdBufferCompatible});
