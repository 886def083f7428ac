// The HBM streaming ceiling of the w4a16 kernel's weight reads, without its arithmetic: how fast can
// 28672 x 8192 (and 8192 x 8192) int4 weights in the prepacked layout (row blocks of 16 rows x 128
// atoms x 512 B) be read with the kernel's access pattern? benchmarks/NOTES.md (session 6) uses it.
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/stream_ceiling benchmarks/stream_ceiling.cu && /tmp/stream_ceiling
// Two readers, each consuming the bytes (XOR) so nothing is optimized away:
//  * ring: the w4a16 main loop's pipeline without its math: CTAs of 8 warps x 4 m16 tiles (32 row
//    blocks) and a K range of the atoms (split-K), a kStages-deep cp.async ring (16 B per lane, L2
//    evict-first), one __syncthreads per atom;
//  * ldg: every warp reads its row blocks' atom range with 16-byte non-coherent loads, 8 in flight.
// Times are CUDA events around chains of back-to-back launches (the best of 3 chains of 20).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CHECK(call)                                                                            \
  do {                                                                                         \
    const cudaError_t status = (call);                                                         \
    if (status != cudaSuccess) {                                                               \
      std::printf("CUDA error %s at line %d\n", cudaGetErrorString(status), __LINE__);         \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

constexpr int kAtomBytes = 512;  // 16 rows x 64 k of int4: one lane's 16 bytes x 32 lanes
constexpr int kAtoms = 8192 / 64;
constexpr int kTilesPerWarp = 4;
constexpr int kWarps = 8;
constexpr size_t kRowBlockBytes = size_t{kAtoms} * kAtomBytes;

__device__ uint32_t g_sink;

template <int kStages>
__global__ void __launch_bounds__(kWarps * 32, 2) RingReader(const uint8_t* weights, int splits) {
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr int kStageBytes = kWarps * kTilesPerWarp * kAtomBytes;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int tile = blockIdx.x / splits, split = blockIdx.x % splits;
  const int atoms = kAtoms / splits;
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  const uint8_t* src = weights + size_t(tile * kWarps * kTilesPerWarp + warp * kTilesPerWarp) * kRowBlockBytes +
                       size_t(split) * atoms * kAtomBytes + lane * 16;
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + (warp * kTilesPerWarp * 32 + lane) * 16;
  auto issue = [&](int atom, int slot) {
    for (int t = 0; t < kTilesPerWarp; ++t) {
      asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(
                       dst + slot * kStageBytes + t * kAtomBytes),
                   "l"(src + t * kRowBlockBytes + size_t(atom) * kAtomBytes), "l"(policy)
                   : "memory");
    }
  };
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < atoms) issue(i, i);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  uint32_t sum = 0;
  for (int i = 0; i < atoms; ++i) {
    asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 2) : "memory");
    __syncthreads();
    if (i + kStages - 1 < atoms) issue(i + kStages - 1, (i + kStages - 1) % kStages);
    asm volatile("cp.async.commit_group;" ::: "memory");
    for (int t = 0; t < kTilesPerWarp; ++t) {
      uint4 v;
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(dst + (i % kStages) * kStageBytes + t * kAtomBytes));
      sum ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  }
  if (sum == 0x9E3779B9u) g_sink = sum;  // never true for the fill below; keeps the reads
}

__global__ void __launch_bounds__(kWarps * 32) LdgReader(const uint8_t* weights, int splits, int tiles_per_warp) {
  constexpr int kInFlight = 8;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int tile = blockIdx.x / splits, split = blockIdx.x % splits;
  const int atoms = kAtoms / splits;
  uint32_t sum = 0;
  for (int t = 0; t < tiles_per_warp; ++t) {
    const uint8_t* src = weights + size_t(tile * kWarps * tiles_per_warp + warp * tiles_per_warp + t) * kRowBlockBytes +
                         size_t(split) * atoms * kAtomBytes + lane * 16;
    for (int i = 0; i < atoms; i += kInFlight) {
      uint4 v[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        asm volatile("ld.global.nc.L1::no_allocate.v4.b32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                     : "l"(src + size_t(i + u) * kAtomBytes));
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) sum ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
  }
  if (sum == 0x9E3779B9u) g_sink = sum;
}

template <typename Launch>
float MicrosecondsPerLaunch(Launch launch) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  launch();
  CHECK(cudaDeviceSynchronize());
  float best = 1e30f;
  for (int chain = 0; chain < 3; ++chain) {
    CHECK(cudaEventRecord(start));
    for (int i = 0; i < 20; ++i) launch();
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    best = std::min(best, ms * 1000.f / 20);
  }
  CHECK(cudaGetLastError());
  return best;
}

template <int kStages>
void RunRing(const uint8_t* weights, int rows, int splits, size_t bytes) {
  const int smem = kStages * kWarps * kTilesPerWarp * kAtomBytes;
  CHECK(cudaFuncSetAttribute(RingReader<kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int grid = rows / 16 / (kWarps * kTilesPerWarp) * splits;
  const float us = MicrosecondsPerLaunch([&] { RingReader<kStages><<<grid, kWarps * 32, smem>>>(weights, splits); });
  std::printf("%5d x 8192  ring  %d stages, %d splits, %4d CTAs   %7.2f us  %5.0f GB/s\n", rows, kStages, splits, grid, us,
              bytes / us / 1e3);
}

int main() {
  const size_t max_bytes = size_t{28672} / 16 * kRowBlockBytes;
  uint8_t* weights = nullptr;
  CHECK(cudaMalloc(&weights, max_bytes));
  CHECK(cudaMemset(weights, 0x5A, max_bytes));
  for (int rows : {28672, 8192}) {
    const size_t bytes = static_cast<size_t>(rows) / 16 * kRowBlockBytes;
    for (int splits : {2, 4, 8}) {
      RunRing<4>(weights, rows, splits, bytes);
      RunRing<5>(weights, rows, splits, bytes);
    }
    for (int splits : {4, 8}) {
      for (int tiles : {1, 2}) {
        const int grid = rows / 16 / (kWarps * tiles) * splits;
        const float us = MicrosecondsPerLaunch([&] { LdgReader<<<grid, kWarps * 32>>>(weights, splits, tiles); });
        std::printf("%5d x 8192  ldg   %d tiles/warp, %d splits, %4d CTAs   %7.2f us  %5.0f GB/s\n", rows, tiles, splits,
                    grid, us, bytes / us / 1e3);
      }
    }
  }
  uint8_t* copy = nullptr;
  CHECK(cudaMalloc(&copy, max_bytes));
  const float us = MicrosecondsPerLaunch([&] { CHECK(cudaMemcpyAsync(copy, weights, max_bytes, cudaMemcpyDeviceToDevice)); });
  std::printf("device-to-device copy of %zu MB: %.2f us, %.0f GB/s (read + write)\n", max_bytes >> 20, us,
              2 * max_bytes / us / 1e3);
  return 0;
}
