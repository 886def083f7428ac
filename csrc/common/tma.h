// mbarriers and TMA tile loads shared by the sm90 GEMMs (one definition per instruction form), and the
// host-side tensor-map encoding both launchers use. Multicast loads and remote arrivals stay in
// w4a4_gemm.cu, the one kernel that uses them; the cluster barriers and remote stores are in common/ptx.h.
#pragma once

#include <cuda.h>          // CUtensorMap and its enums (types only; libcuda is reached through the runtime)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime.h>

#include <cstdint>

#include "common/ptx.h"
#include "common/smem_budget.h"

namespace jax_w4a4::tma {

// ------------------------------------------------------------------------------------------ device

__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Makes the initialized barriers visible to the async proxy (TMA complete_tx) and the cluster.
__device__ __forceinline__ void FenceMbarInit() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void MbarArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Spins until the barrier's phase of this parity has completed.
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// The first kSwizzledAlign-aligned shared address at or after the dynamic shared memory `smem`: the base
// of a kernel whose 128-byte-swizzled TMA destinations need 1 KB alignment (its plan allocates the slack).
__device__ __forceinline__ uint32_t SwizzledSharedBase(const void* smem) {
  return (ptx::SharedAddress(smem) + budget::kSwizzledAlign - 1) & ~uint32_t{budget::kSwizzledAlign - 1};
}

__device__ __forceinline__ uint64_t MapAddr(const CUtensorMap& map) { return reinterpret_cast<uint64_t>(&map); }

__device__ __forceinline__ void TmaPrefetch(const CUtensorMap& map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(MapAddr(map)) : "memory");
}

// The box at (c0, c1) into shared memory at dst; its bytes complete_tx on bar (out-of-bounds elements
// land as zeros and count too).
__device__ __forceinline__ void TmaLoad2d(const CUtensorMap& map, uint32_t dst, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          dst),
      "l"(MapAddr(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

// TmaLoad2d with an L2 cache policy (ptx::L2EvictFirstPolicy for data read exactly once).
__device__ __forceinline__ void TmaLoad2dHint(const CUtensorMap& map, uint32_t dst, uint32_t bar, int c0, int c1,
                                              uint64_t l2_policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(dst),
      "l"(MapAddr(map)), "r"(bar), "r"(c0), "r"(c1), "l"(l2_policy)
      : "memory");
}

// The 3-D box at (c0, c1, c2), with an L2 cache policy.
__device__ __forceinline__ void TmaLoad3dHint(const CUtensorMap& map, uint32_t dst, uint32_t bar, int c0, int c1,
                                              int c2, uint64_t l2_policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(dst),
      "l"(MapAddr(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "l"(l2_policy)
      : "memory");
}

// `bytes` contiguous bytes (a multiple of 16, both addresses 16-byte aligned) into shared memory at dst;
// they complete_tx on bar.
__device__ __forceinline__ void BulkLoad(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// cp.async of kBytes (4, 8 or 16; dst and src aligned to it); src_bytes = 0 fills zeros (out-of-bounds rows).
// Small pieces of strided rows, which TMA boxes and bulk copies would take with more setup; their completion
// reaches a barrier through CpAsyncArriveNoinc.
template <int kBytes>
__device__ __forceinline__ void CpAsync(uint32_t dst, const void* src, uint32_t src_bytes) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async.ca takes 4, 8 or 16 bytes");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(src), "n"(kBytes), "r"(src_bytes)
               : "memory");
}

// Arrives on `bar` once all of this thread's prior cp.async have landed (counts as one arrival).
__device__ __forceinline__ void CpAsyncArriveNoinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// -------------------------------------------------------------------------------------------- host

using EncodeTiledFn = PFN_cuTensorMapEncodeTiled_v12000;

inline EncodeTiledFn GetEncodeTiled() {
  static const EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult query;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &query) !=
            cudaSuccess ||
        query != cudaDriverEntryPointSuccess) {
      return EncodeTiledFn{nullptr};
    }
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

// Bytes of a box in shared memory (and on its mbarrier's transaction count).
template <int kRank>
constexpr uint32_t BoxBytes(const uint32_t (&box)[kRank], uint32_t element_bytes) {
  uint32_t bytes = element_bytes;
  for (int i = 0; i < kRank; ++i) bytes *= box[i];
  return bytes;
}

// A row-major tensor: dims innermost first, strides (bytes) of dims 1.., box innermost first.
// Out-of-bounds elements of a box read as zero.
template <int kRank>
bool EncodeTiled(CUtensorMap* map, CUtensorMapDataType type, const void* base, const uint64_t (&dims)[kRank],
                 const uint64_t (&strides)[kRank - 1], const uint32_t (&box)[kRank], CUtensorMapSwizzle swizzle) {
  const EncodeTiledFn encode = GetEncodeTiled();
  if (encode == nullptr) return false;
  uint32_t element_strides[kRank];
  for (int i = 0; i < kRank; ++i) element_strides[i] = 1;
  const CUresult result = encode(map, type, kRank, const_cast<void*>(base), dims, strides, box, element_strides,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS;
}

}  // namespace jax_w4a4::tma
