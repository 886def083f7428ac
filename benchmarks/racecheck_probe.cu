// Does compute-sanitizer racecheck follow the orderings w4a4_gemm relies on? (benchmarks/NOTES.md, session 46.)
// racecheck reports hazards in w4a4_gemm between the producer's copies of the scales (a bulk copy, 4-byte cp.async)
// and the consumers' shared-memory loads of them. This probe runs the same pipeline in miniature: one stage, a
// producer warp (warp 0) that fills it each round, three consumer warps that wait on its full mbarrier, read it and
// release it on its empty mbarrier, which the producer waits on before the next round's copy. Modes:
//   bulk-all         lane 0 of the producer bulk-copies the stage (complete_tx); every consumer lane arrives on empty
//   cpasync-all      every producer lane cp.asyncs 32 bytes and arrives with cp.async.mbarrier.arrive.noinc
//   bulk-elected     as bulk-all, but each consumer warp releases as w4a4_gemm does: __syncwarp, then lane 0 arrives
//   cpasync-elected  as cpasync-all with that release
//   race             a real race: the consumers also read the stage before waiting on full (control)
// Every mode but race is correct (the PTX memory model orders a lane's read, __syncwarp, lane 0's release arrive and
// the producer's acquire wait), and the probe checks the values read. Build and run on the GPU machine:
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O2 -lineinfo -I csrc -o /tmp/racecheck_probe \
//     benchmarks/racecheck_probe.cu
//   for m in bulk-all cpasync-all bulk-elected cpasync-elected race; do
//     compute-sanitizer --tool racecheck --print-limit 2 /tmp/racecheck_probe $m; done
// Session 46 (racecheck 2025.3.1): no hazard in bulk-all and cpasync-all; hazards in bulk-elected, cpasync-elected
// (between the consumers' read and the next round's copy) and race. So the tool does not carry a lane's read
// through __syncwarp to another lane's arrive, and w4a4_gemm's reports are that pattern.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "common/tma.h"

namespace {

using namespace jax_w4a4::tma;

constexpr int kStageFloats = 256;  // 1 KB
constexpr int kRounds = 4;
constexpr int kConsumerWarps = 3;

enum class Copy { kBulk, kCpAsync };
enum class Release { kEveryLane, kElectedLane, kRace };

__global__ void Pipeline(const float* src, float* out, Copy copy, Release release) {
  __shared__ alignas(128) float stage[kStageFloats];
  __shared__ alignas(8) uint64_t barriers[2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t full = static_cast<uint32_t>(__cvta_generic_to_shared(&barriers[0]));
  const uint32_t empty = static_cast<uint32_t>(__cvta_generic_to_shared(&barriers[1]));
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(stage));
  if (threadIdx.x == 0) {
    MbarInit(full, copy == Copy::kBulk ? 1 : 32);
    MbarInit(empty, release == Release::kEveryLane ? 32 * kConsumerWarps : kConsumerWarps);
    FenceMbarInit();
  }
  __syncthreads();
  float sum = 0.f;
  for (int r = 0; r < kRounds; ++r) {
    const float* round_src = src + kStageFloats * r;
    if (warp == 0) {
      if (r > 0) MbarWait(empty, (r - 1) & 1);
      if (copy == Copy::kBulk) {
        if (lane == 0) {
          MbarArriveExpectTx(full, kStageFloats * 4);
          BulkLoad(dst, round_src, kStageFloats * 4, full);
        }
      } else {
        for (int i = lane; i < kStageFloats; i += 32) CpAsync<4>(dst + 4 * i, round_src + i, 4);
        CpAsyncArriveNoinc(full);
      }
    } else {
      const int index = (threadIdx.x * 7 + r) % kStageFloats;
      if (release == Release::kRace) sum += stage[index];
      MbarWait(full, r & 1);
      sum += stage[index];
      if (release == Release::kEveryLane) {
        MbarArrive(empty);
      } else {
        __syncwarp();
        if (lane == 0) MbarArrive(empty);
      }
    }
  }
  out[threadIdx.x] = sum;
}

}  // namespace

int main(int argc, char** argv) {
  struct Mode {
    const char* name;
    Copy copy;
    Release release;
  };
  const Mode modes[] = {{"bulk-all", Copy::kBulk, Release::kEveryLane},
                        {"cpasync-all", Copy::kCpAsync, Release::kEveryLane},
                        {"bulk-elected", Copy::kBulk, Release::kElectedLane},
                        {"cpasync-elected", Copy::kCpAsync, Release::kElectedLane},
                        {"race", Copy::kBulk, Release::kRace}};
  const Mode* mode = nullptr;
  for (const Mode& m : modes) {
    if (argc > 1 && std::strcmp(argv[1], m.name) == 0) mode = &m;
  }
  if (mode == nullptr) {
    std::fprintf(stderr, "usage: %s bulk-all|cpasync-all|bulk-elected|cpasync-elected|race\n", argv[0]);
    return 2;
  }
  constexpr int kThreads = 32 * (1 + kConsumerWarps);
  float host_src[kStageFloats * kRounds], host_out[kThreads];
  for (int i = 0; i < kStageFloats * kRounds; ++i) host_src[i] = static_cast<float>(i % 97 + 1);
  float *src = nullptr, *out = nullptr;
  cudaMalloc(&src, sizeof(host_src));
  cudaMalloc(&out, sizeof(host_out));
  cudaMemcpy(src, host_src, sizeof(host_src), cudaMemcpyHostToDevice);
  Pipeline<<<1, kThreads>>>(src, out, mode->copy, mode->release);
  const cudaError_t status = cudaDeviceSynchronize();
  cudaMemcpy(host_out, out, sizeof(host_out), cudaMemcpyDeviceToHost);
  int wrong = 0;
  for (int t = 32; t < kThreads; ++t) {
    float want = 0.f;
    for (int r = 0; r < kRounds; ++r) want += host_src[kStageFloats * r + (t * 7 + r) % kStageFloats];
    wrong += mode->release != Release::kRace && host_out[t] != want;
  }
  std::printf("%s: %s, %d consumer threads read a wrong value\n", mode->name, cudaGetErrorString(status), wrong);
  cudaFree(src);
  cudaFree(out);
  return status == cudaSuccess && wrong == 0 ? 0 : 1;
}
