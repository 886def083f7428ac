// How long the first bytes of a kernel take to arrive from HBM, by load path (benchmarks/NOTES.md, session 36): a
// narrow w4a16 CTA's first stage lands ~1.7 us after the CTA starts, and this probe says how much of that a single
// load of each kind takes on its own. One CTA per SM (128 CTAs, 100 KB of dynamic shared memory each); thread 0
// reads %globaltimer at entry and when its load has landed, for
//   ldg        one 16-byte ld.global.cg (its value consumed);
//   bulk       one 8 KB cp.async.bulk (no tensor map) onto an mbarrier;
//   tma        one 8 KB TMA box (a 2-D uint8 tensor map, 64 rows of 128 B) after prefetch.tensormap, as the kernels do;
//   tma-cold   the same without the prefetch.
// Every launch reads a region no earlier launch read, after a 256 MB memset that evicts L2. Build and run on the
// GPU machine:
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -I csrc -o /tmp/first_load_probe \
//     benchmarks/first_load_probe.cu && /tmp/first_load_probe
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "common/ptx.h"
#include "common/tma.h"

namespace {

namespace tma = jax_w4a4::tma;

enum class Path { kLdg, kBulk, kTma, kTmaCold };
constexpr int kCtas = 128;
constexpr int kBoxBytes = 8192;  // a narrow stage's weights
constexpr int kSmemBytes = 100 * 1024;
constexpr size_t kRegionBytes = size_t{kCtas} * kBoxBytes;
constexpr int kLaunches = 24;
constexpr size_t kFlushBytes = size_t{256} << 20;

__device__ __forceinline__ uint64_t Now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

template <Path kPath>
__global__ void __launch_bounds__(32) FirstLoad(const __grid_constant__ CUtensorMap map, const uint8_t* region,
                                                int first_row, uint64_t* out) {
  extern __shared__ __align__(1024) uint8_t smem[];
  if (threadIdx.x != 0) return;
  const uint64_t start = Now();
  const uint32_t dst = jax_w4a4::ptx::SharedAddress(smem);
  const uint32_t bar = dst + kBoxBytes;
  uint32_t sink = 0;
  if constexpr (kPath == Path::kLdg) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(region + size_t{blockIdx.x} * kBoxBytes));
    sink = v.x ^ v.y ^ v.z ^ v.w;
  } else {
    if constexpr (kPath == Path::kTma) tma::TmaPrefetch(map);
    tma::MbarInit(bar, 1);
    tma::FenceMbarInit();
    tma::MbarArriveExpectTx(bar, kBoxBytes);
    if constexpr (kPath == Path::kBulk) {
      tma::BulkLoad(dst, region + size_t{blockIdx.x} * kBoxBytes, kBoxBytes, bar);
    } else {
      tma::TmaLoad2d(map, dst, bar, 0, first_row + blockIdx.x * (kBoxBytes / 128));
    }
    tma::MbarWait(bar, 0);
  }
  asm volatile("" ::"r"(sink));  // the load's value is consumed before the clock is read
  const uint64_t landed = Now();
  out[2 * blockIdx.x] = start;
  // The sink also reaches memory: consumed by the empty asm alone, the load was dropped from the SASS.
  out[2 * blockIdx.x + 1] = landed + (sink == 0x12345678u ? 1 : 0);
}

using Kernel = void (*)(const CUtensorMap, const uint8_t*, int, uint64_t*);
constexpr Kernel kKernels[] = {FirstLoad<Path::kLdg>, FirstLoad<Path::kBulk>, FirstLoad<Path::kTma>,
                               FirstLoad<Path::kTmaCold>};
constexpr const char* kPathNames[] = {"ldg", "bulk", "tma", "tma-cold"};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

bool Check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) std::printf("%s: %s\n", what, cudaGetErrorString(status));
  return status == cudaSuccess;
}

}  // namespace

int main() {
  const size_t weight_bytes = kRegionBytes * kLaunches * 4;  // 4 paths x 24 launches, each region read once
  uint8_t *weights = nullptr, *flush = nullptr;
  uint64_t* out = nullptr;
  if (!Check(cudaMalloc(&weights, weight_bytes), "cudaMalloc") || !Check(cudaMalloc(&flush, kFlushBytes), "cudaMalloc") ||
      !Check(cudaMalloc(&out, 2 * kCtas * sizeof(uint64_t)), "cudaMalloc")) {
    return 1;
  }
  Check(cudaMemset(weights, 0x5a, weight_bytes), "cudaMemset");
  CUtensorMap map;
  const uint64_t rows = weight_bytes / 128;
  if (!tma::EncodeTiled<2>(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, weights, {128, rows}, {128}, {128, kBoxBytes / 128},
                           CU_TENSOR_MAP_SWIZZLE_NONE)) {
    std::printf("cuTensorMapEncodeTiled failed\n");
    return 1;
  }
  for (Kernel kernel : kKernels) {
    Check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes), "attr");
  }
  std::vector<uint64_t> host(2 * kCtas);
  std::printf("path      median / max over CTAs of (landed - CTA start), us: median over %d launches (min-max)\n",
              kLaunches);
  int region_index = 0;
  for (int path = 0; path < 4; ++path) {
    std::vector<double> medians, maxima;
    for (int launch = -2; launch < kLaunches; ++launch) {  // two warm-up launches
      const size_t offset = kRegionBytes * (region_index++ % (kLaunches * 4));
      Check(cudaMemset(flush, launch & 0xff, kFlushBytes), "flush");
      const int first_row = static_cast<int>(offset / 128);
      kKernels[path]<<<kCtas, 32, kSmemBytes>>>(map, weights + offset, first_row, out);
      if (!Check(cudaDeviceSynchronize(), kPathNames[path])) return 1;
      if (launch < 0) continue;
      Check(cudaMemcpy(host.data(), out, host.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost), "copy");
      std::vector<double> waits(kCtas);
      for (int c = 0; c < kCtas; ++c) waits[c] = (host[2 * c + 1] - host[2 * c]) / 1000.0;
      medians.push_back(Median(waits));
      maxima.push_back(*std::max_element(waits.begin(), waits.end()));
    }
    std::printf("%-9s %.2f (%.2f-%.2f) / %.2f (%.2f-%.2f)\n", kPathNames[path], Median(medians),
                *std::min_element(medians.begin(), medians.end()), *std::max_element(medians.begin(), medians.end()),
                Median(maxima), *std::min_element(maxima.begin(), maxima.end()),
                *std::max_element(maxima.begin(), maxima.end()));
  }
  return 0;
}
