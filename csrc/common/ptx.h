// PTX wrappers shared by the sm90 kernels (one definition per instruction form); wgmma is in
// common/wgmma.h, mbarriers and TMA loads in common/tma.h. Wrappers one kernel uses stay in its file.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace jax_w4a4::ptx {

__device__ __forceinline__ uint32_t SharedAddress(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// setmaxnreg: a warpgroup gives registers back to the CTA's launch pool (Dec) or takes them from it (Inc, which
// blocks until the pool holds them: only what another warpgroup gave back).
template <int kRegisters>
__device__ __forceinline__ void SetMaxRegistersDec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void SetMaxRegistersInc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

// L2 cache policies for cache-hinted loads: evict-first for data read exactly once (streamed weights).
__device__ __forceinline__ uint64_t L2EvictFirstPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ uint64_t L2EvictNormalPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// Programmatic dependent launch (a kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization
// may start while the previous kernel of the stream still runs). LaunchDependents: this CTA lets the next
// kernel start. WaitForPreviousGrid: blocks until the previous kernel has finished and its memory is
// visible; returns at once in a kernel not launched that way.
__device__ __forceinline__ void LaunchDependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void WaitForPreviousGrid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// D += A·B, m16n8k16, bf16 or fp16 operands (T), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "bf16 or fp16 operands");
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// ---- clusters (sm_90)

__device__ __forceinline__ uint32_t ClusterCtaRank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// Every thread of every CTA of the cluster, in step (.aligned: the whole warp executes it).
__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// ClusterSync's two halves, for threads that arrive early and wait late (not .aligned: a divergent warp's
// threads may reach them at different times). Every thread arrives once and waits once.
__device__ __forceinline__ void ClusterArriveRelease() { asm volatile("barrier.cluster.arrive.release;" ::: "memory"); }
__device__ __forceinline__ void ClusterWaitAcquire() { asm volatile("barrier.cluster.wait.acquire;" ::: "memory"); }

// The address of `addr` (this CTA's shared memory) in CTA `cta` of the cluster.
__device__ __forceinline__ uint32_t MapSharedToCta(uint32_t addr, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(cta));
  return remote;
}

// 16 bytes into another CTA's shared memory (addresses from MapSharedToCta), counted as complete_tx bytes
// on that CTA's mbarrier `remote_bar`: the receiver waits on its barrier, not on the sender.
__device__ __forceinline__ void StoreAsyncRemote(uint32_t remote_addr, float4 v, uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
               ::"r"(remote_addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(remote_bar)
               : "memory");
}

}  // namespace jax_w4a4::ptx
