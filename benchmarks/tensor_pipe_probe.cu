// Tensor-pipe rates of the MMA instructions the w4a16 kernel uses, measured in isolation (benchmarks/NOTES.md,
// session 33): mma.sync m16n8k16 bf16 -> f32 (cycles per instruction per SM sub-partition, by warps per
// sub-partition and by independent accumulators per warp), and wgmma m64nNk16 bf16 with A from registers
// (cycles per instruction per SM, by N and warpgroups; then with A dequantized before every commit group, as in
// the kernel's wgmma steps). One CTA per SM (200 KB of dynamic shared memory each), clock64 around the loop,
// averaged over the SMs; no memory traffic in the loop. Build and run on the GPU machine:
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -I csrc -o /tmp/tensor_pipe_probe \
//     benchmarks/tensor_pipe_probe.cu && /tmp/tensor_pipe_probe
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "common/wgmma.h"

namespace {

using jax_w4a4::sm90::FenceOperands;
using jax_w4a4::sm90::kSwizzleNone;
using jax_w4a4::sm90::MakeSmemDesc;
using jax_w4a4::sm90::Wgmma;
using jax_w4a4::sm90::WgmmaCommit;
using jax_w4a4::sm90::WgmmaFence;
using jax_w4a4::sm90::WgmmaWait;

// Loop trips, passed to the kernels at run time: with a constant trip count ptxas unrolled the wgmma loop and
// injected warpgroup waits into it (C7517).
constexpr int kIters = 2048;
constexpr int kSmemBytes = 200 * 1024;  // one CTA per SM
constexpr int kWgmmasPerGroup = 4;      // wgmmas per commit group with a constant A

__device__ __forceinline__ void MmaSync(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Each warp issues iters x kChains MMAs into kChains independent accumulators.
template <int kChains>
__global__ void MmaSyncLoop(float* sink, long long* cycles, int iters) {
  const uint32_t a[4] = {threadIdx.x * 0x00010001u, 0x3F803F80u, 0x3F803F80u, threadIdx.x};
  const uint32_t b0 = 0x3F803F80u ^ threadIdx.x, b1 = 0x3F003F00u;
  float acc[kChains][4] = {};
  __syncthreads();
  const long long start = clock64();
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) MmaSync(acc[c], a, b0, b1);
  }
  __syncthreads();
  const long long end = clock64();
  float sum = 0.f;
#pragma unroll
  for (int c = 0; c < kChains; ++c) sum += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = sum;
  if (threadIdx.x == 0) cycles[blockIdx.x] = end - start;
}

// The w4a16 kernel's bf16 dequantization of one A register: nibbles p and p + 4 of a word, as q - 8 in bf16.
__device__ __forceinline__ uint32_t DequantizeBf16(uint32_t word, int p) {
  uint32_t masked, a;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(masked) : "r"(word >> (4 * p)), "r"(0x000F000Fu), "r"(0x43004300u));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(a) : "r"(masked), "r"(0x3F803F80u), "r"(0xC308C308u));
  return a;
}

// Each warpgroup issues iters commit groups of kTiles wgmmas (one accumulator each), at most two groups in
// flight. kDequantize: every group's A registers are first computed from a fresh word per tile, as the w4a16
// kernel's steps do (3 shifts, 4 lop3 and 4 packed FMAs per 8 weights); else A is constant.
template <int kN, int kTiles, bool kDequantize>
__global__ void WgmmaLoop(float* sink, long long* cycles, int iters) {
  extern __shared__ __align__(1024) uint8_t smem[];
  for (int i = threadIdx.x; i < 16 * 256 / 2; i += blockDim.x) reinterpret_cast<uint32_t*>(smem)[i] = 0x3F803F80u;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const uint64_t desc_b = MakeSmemDesc(static_cast<uint32_t>(__cvta_generic_to_shared(smem)), 128, 256, kSwizzleNone);
  float acc[kTiles][kN / 2] = {};
  const long long start = clock64();
  for (int i = 0; i < iters; ++i) {
    uint32_t a[kTiles][4];
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        a[t][p] = kDequantize ? DequantizeBf16((threadIdx.x + 7 * t) * 0x9E3779B9u + i, p) : 0x3F803F80u;
      }
    }
    WgmmaFence();
#pragma unroll
    for (int t = 0; t < kTiles; ++t) Wgmma<kN>::template Half<true>(acc[t], a[t], desc_b, 1);
    WgmmaCommit();
    WgmmaWait<1>();
  }
  WgmmaWait<0>();
#pragma unroll
  for (int t = 0; t < kTiles; ++t) FenceOperands(acc[t]);
  __syncthreads();
  const long long end = clock64();
  float sum = 0.f;
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int e = 0; e < kN / 2; ++e) sum += acc[t][e];
  }
  sink[blockIdx.x * blockDim.x + threadIdx.x] = sum;
  if (threadIdx.x == 0) cycles[blockIdx.x] = end - start;
}

// Mean cycles of the timed loop over the SMs (-1 on a CUDA error, which is printed).
template <typename Kernel>
double MeanLoopCycles(Kernel kernel, int threads, int sms, float* sink, long long* cycles) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  for (int run = 0; run < 2; ++run) kernel<<<sms, threads, kSmemBytes>>>(sink, cycles, kIters);  // the first warms up
  const cudaError_t error = cudaDeviceSynchronize();
  if (error != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(error));
    return -1.0;
  }
  long long host[1024];
  cudaMemcpy(host, cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost);
  double sum = 0.0;
  for (int i = 0; i < sms; ++i) sum += static_cast<double>(host[i]);
  return sum / sms;
}

template <int kChains>
void ReportMmaSync(int warps_per_subpartition, int sms, float* sink, long long* cycles) {
  const double loop = MeanLoopCycles(MmaSyncLoop<kChains>, 4 * 32 * warps_per_subpartition, sms, sink, cycles);
  const double per_mma = loop / (static_cast<double>(kIters) * kChains * warps_per_subpartition);
  std::printf("  mma.sync, %d warp(s) per sub-partition, %d chain(s) a warp: %5.2f cycles (%4.0f MAC/clk/SM)\n",
              warps_per_subpartition, kChains, per_mma, 4 * 16 * 8 * 16 / per_mma);
}

template <int kN, int kTiles = kWgmmasPerGroup, bool kDequantize = false>
void ReportWgmma(int warpgroups, int sms, float* sink, long long* cycles) {
  const double loop = MeanLoopCycles(WgmmaLoop<kN, kTiles, kDequantize>, 128 * warpgroups, sms, sink, cycles);
  const double per_wgmma = loop / (static_cast<double>(kIters) * kTiles * warpgroups);
  std::printf("  wgmma m64n%dk16, %d warpgroup(s), %d per group%s: %5.2f cycles per SM (%4.0f MAC/clk/SM)\n", kN,
              warpgroups, kTiles, kDequantize ? ", A dequantized each group" : "", per_wgmma, 64 * kN * 16 / per_wgmma);
}

}  // namespace

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  if (sms <= 0 || sms > 1024) {
    std::printf("no usable CUDA device\n");
    return 1;
  }
  float* sink = nullptr;
  long long* cycles = nullptr;
  cudaMalloc(&sink, static_cast<size_t>(sms) * 1024 * sizeof(float));
  cudaMalloc(&cycles, static_cast<size_t>(sms) * sizeof(long long));
  std::printf("mma.sync m16n8k16 bf16 -> f32: cycles per MMA per SM sub-partition\n");
  for (int warps : {1, 2, 4}) {
    ReportMmaSync<8>(warps, sms, sink, cycles);
    ReportMmaSync<2>(warps, sms, sink, cycles);
    ReportMmaSync<1>(warps, sms, sink, cycles);
  }
  std::printf("wgmma bf16, A from registers, one accumulator per wgmma of a commit group\n");
  for (int warpgroups : {1, 2}) {
    ReportWgmma<8>(warpgroups, sms, sink, cycles);
    ReportWgmma<16>(warpgroups, sms, sink, cycles);
    ReportWgmma<32>(warpgroups, sms, sink, cycles);
    ReportWgmma<64>(warpgroups, sms, sink, cycles);
  }
  // the w4a16 kernel's wgmma steps (32 tokens: 4 m16 tiles a warp, 64: 2) and session 30's 16-token try (4)
  ReportWgmma<16, 4, true>(2, sms, sink, cycles);
  ReportWgmma<32, 4, true>(2, sms, sink, cycles);
  ReportWgmma<64, 2, true>(2, sms, sink, cycles);
  cudaFree(sink);
  cudaFree(cycles);
  return 0;
}
