// Arrival counters that re-arm themselves, so a launch needs no memset before it.
//
// The split-K reductions (act_quant's LA partials, w4a16's fragment partials) and W4A4's stream-K flags
// count CTAs (w4a16: warps) arriving at a shared result. Zeroing such counters in the XLA workspace took a
// cudaMemsetAsync before every launch, which cost ~2.4 µs of GPU time per call in a chain of decode
// GEMMs (benchmarks/NOTES.md, session 8): 5% of a 45 µs layer. Instead the counters live in device memory
// the library owns (one pool per kernel file: a `static` variable of this header), zero when the module
// loads, and every launch leaves the counters it used at 0 again before it exits (the CTA or warp that sees
// the last arrival re-arms its counter). The next launch of the kernel in the stream starts after this one
// has finished, so it always finds zeros.
//
// The price: two launches of one kernel must not run at the same time on one device, as they would
// share counters. XLA runs a device's custom calls one after another on its compute stream, also inside
// command buffers with the default scheduling (LHS); W4A4's stream-K needs that anyway (its finishing
// CTAs wait for others, which must all be resident). docs/layouts.md, "Arrival counters".
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#include <cuda_runtime.h>

#include <vector>
#endif

namespace jax_w4a4 {

// The largest SM count a launch may be planned for (the handlers reject larger `num_sms` attributes).
inline constexpr int kMaxNumSms = 1024;
// Counters per kernel: the most one launch planned for kMaxNumSms SMs may use (each plan header
// static_asserts its bound; w4a16's split-K takes the most: one per column tile and row warp, 8192).
inline constexpr int64_t kArrivalCounters = 8192;

#ifdef __CUDACC__
static __device__ uint32_t g_arrival_counters[kArrivalCounters];

// A CTA's arrival in two halves, so that it can go on working between its arrival and the answer. ArriveBegin:
// called by every thread after its share of the result is stored; thread 0 arrives with one acq_rel atomic
// (release: the CTA's stores, ordered before it by bar.sync, are visible to whoever acquires the counter;
// acquire: if it arrives last it sees every other CTA's stores), and the other warps do not wait for it.
// ArriveEnd(what ArriveBegin returned): called by every thread later; true in every thread of the CTA that
// arrived last of `arrivals` at `counter` (bar.sync carries thread 0's acquire to the CTA's other threads,
// as in CUTLASS's semaphores). That CTA re-arms the counter; no other CTA of the launch touches it again.
// No separate fences: __threadfence() is fence.sc.gpu (MEMBAR.SC.GPU), which thread 0 ran before its atomic and
// every thread of the last CTA after it; the acq_rel atomic is one MEMBAR.ALL.GPU in thread 0 (session 23:
// 0.1-0.9 us less per split call in act_quant, w4a16 and W4A4's stream-K; benchmarks/NOTES.md).
// One arrival: an acq_rel atomic increment at GPU scope; the arrivals before it.
__device__ __forceinline__ uint32_t ArriveAcqRel(uint32_t* counter) {
  uint32_t earlier_arrivals;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(earlier_arrivals) : "l"(counter) : "memory");
  return earlier_arrivals;
}

__device__ __forceinline__ uint32_t ArriveBegin(uint32_t* counter) {
  __syncthreads();
  return threadIdx.x == 0 ? ArriveAcqRel(counter) : 0;  // the result is read only in ArriveEnd
}

__device__ __forceinline__ bool ArriveEnd(uint32_t* counter, uint32_t arrivals, uint32_t earlier_arrivals) {
  const bool last = threadIdx.x == 0 && earlier_arrivals == arrivals - 1;
  if (last) atomicExch(counter, 0u);
  return __syncthreads_or(last);
}

// One warp's arrival, whose CTA's other warps go on (no bar.sync: a CTA's warps end their loops up to
// microseconds apart; w4a16's split-K, session 32). Called by every lane after its share of the result is
// stored; lane 0 arrives with one acq_rel atomic (__syncwarp orders the lanes' stores before it, as bar.sync
// does for a CTA) and re-arms the counter when it is the last of `arrivals`; true in every lane of that warp
// (__syncwarp carries lane 0's acquire to them).
__device__ __forceinline__ bool WarpArriveLast(uint32_t* counter, uint32_t arrivals) {
  __syncwarp();
  uint32_t earlier_arrivals = 0;
  if (threadIdx.x % 32 == 0) {
    earlier_arrivals = ArriveAcqRel(counter);
    if (earlier_arrivals == arrivals - 1) atomicExch(counter, 0u);
  }
  const bool last = __shfl_sync(0xFFFFFFFFu, earlier_arrivals, 0) == arrivals - 1;
  __syncwarp();
  return last;
}

// Host check of the invariant (for tests; synchronizes the current device): how many counters of this
// file's pool are not zero, or -1 when the pool cannot be read.
static int64_t ArmedArrivalCounters() {
  std::vector<uint32_t> words(kArrivalCounters);
  if (cudaMemcpyFromSymbol(words.data(), g_arrival_counters, words.size() * sizeof(uint32_t)) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  int64_t armed = 0;
  for (uint32_t w : words) armed += w != 0;
  return armed;
}
#endif

}  // namespace jax_w4a4
