// stream_peer (benchmarks only, not an op of the package): the bytes act_quant must move, with no arithmetic.
// Reads 2 bytes per value (X, bf16/fp16) and writes 1 (act_quant's q code): the high byte of each value. It
// tells the act_quant benchmark what a plain streaming kernel of the same traffic reaches in the same run
// (session 27, in the benchmark's jitted chains: 85% of 4.2 TB/s at 4096 x 4096, 92% at 4096 x 12288 — the
// ceiling under act_quant's 80% floor). Roles: every thread streams; no shared memory, no pipeline beyond
// two 16-byte loads per thread step in flight (a probe with 1-8 steps unrolled and 4-8 CTAs per SM, as
// plain back-to-back launches: all within 2%, 77% / 88% of 4.2 TB/s).
#include "kernels/stream_peer.h"

#include <algorithm>

#include "common/device_info.h"

namespace jax_w4a4 {
namespace {

constexpr int kThreads = 256;
constexpr int kCtasPerSm = 4;

__device__ __forceinline__ uint4 LoadStreaming(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// The high bytes of the four 16-bit values in words a and b.
__device__ __forceinline__ uint32_t HighBytes(uint32_t a, uint32_t b) { return __byte_perm(a, b, 0x7531); }

__global__ void __launch_bounds__(kThreads) StreamPeerKernel(const uint4* __restrict__ x, uint4* __restrict__ out,
                                                             int64_t steps) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < steps; i += stride) {
    const uint4 a = LoadStreaming(x + 2 * i);
    const uint4 b = LoadStreaming(x + 2 * i + 1);
    out[i] = make_uint4(HighBytes(a.x, a.y), HighBytes(a.z, a.w), HighBytes(b.x, b.y), HighBytes(b.z, b.w));
  }
}

}  // namespace

cudaError_t LaunchStreamPeer(const void* x, void* out, int64_t values, cudaStream_t stream) {
  int sms = 0;
  if (cudaError_t status = CurrentDeviceSms(sms); status != cudaSuccess) return status;
  const int64_t steps = values / kStreamPeerValueGranule;
  if (steps == 0) return cudaSuccess;
  const int64_t ctas = std::min<int64_t>(int64_t{sms} * kCtasPerSm, (steps + kThreads - 1) / kThreads);
  StreamPeerKernel<<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(static_cast<const uint4*>(x),
                                                                          static_cast<uint4*>(out), steps);
  return cudaGetLastError();
}

}  // namespace jax_w4a4
