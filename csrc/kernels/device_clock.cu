// device_clock: one thread reads the GPU's global nanosecond timer (%globaltimer) into a device buffer.
// The benchmarks bracket a chain of kernels in one jit with two of these (benchmarks/harness.py), so
// the chain is timed on the GPU, in its own stream, without the host's dispatch and wait in the number.
#include "kernels/device_clock.h"

namespace jax_w4a4 {
namespace {

__global__ void ReadGlobalTimer(uint64_t* out) {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  *out = now;
}

}  // namespace

cudaError_t LaunchReadGlobalTimer(uint64_t* out, cudaStream_t stream) {
  ReadGlobalTimer<<<1, 1, 0, stream>>>(out);
  return cudaGetLastError();
}

}  // namespace jax_w4a4
