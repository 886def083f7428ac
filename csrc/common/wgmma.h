// wgmma and its fences, shared by the sm90 kernels that issue it (w4a4_gemm, w4a16_gemm): one
// definition per instruction form. An inline-asm string must be a literal, so every (N, dtype) form is
// spelled out.
#pragma once

#include <cstdint>

namespace jax_w4a4::sm90 {

// Generic-proxy writes to shared memory become visible to the async proxy (wgmma, TMA store).
__device__ __forceinline__ void FenceProxyAsync() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// wait_group takes an immediate; `pending` is a constant once the caller's loops are unrolled.
__device__ __forceinline__ void WgmmaWaitPending(int pending) {
  switch (pending) {
    case 0: WgmmaWait<0>(); break;
    case 1: WgmmaWait<1>(); break;
    case 2: WgmmaWait<2>(); break;
    case 3: WgmmaWait<3>(); break;
    case 4: WgmmaWait<4>(); break;
    case 5: WgmmaWait<5>(); break;
    case 6: WgmmaWait<6>(); break;
    default: WgmmaWait<7>(); break;
  }
}

// Keeps the compiler from moving accesses of wgmma accumulators across the wgmma / wait statements.
template <int kN>
__device__ __forceinline__ void FenceOperands(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// Shared-memory matrix descriptor of wgmma: start address, leading / stride byte offsets (16-byte
// units), swizzle mode in bits 62-63.
enum : uint32_t { kSwizzleNone = 0, kSwizzle128B = 1, kSwizzle64B = 2, kSwizzle32B = 3 };
__device__ __forceinline__ uint64_t MakeSmemDesc(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes,
                                                 uint32_t swizzle) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(lbo_bytes >> 4) << 16) | (uint64_t(sbo_bytes >> 4) << 32) |
         (uint64_t(swizzle) << 62);
}

// ---------------------------------------------------------------------------------------------------
// wgmma (D: m64 x N fp32 fragment, N/2 registers per thread: d[4i + 2h + e] = row g + 8h, column
// 8i + 2t + e of the warp's 16 rows, g = lane / 4, t = lane % 4).

template <int kN>
struct Wgmma;

template <>
struct Wgmma<8> {
  // D[64 x N] (+)= A[64 x 32] (e4m3, registers) * B[32 x N] (e4m3, shared memory, K-major).
  static __device__ __forceinline__ void E4m3(float (&d)[4], const uint32_t* a, uint64_t desc_b, uint32_t scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
  }
  // D[64 x N] (+)= A[64 x 16] (16-bit, registers) * B[16 x N] (16-bit, shared memory, K-major).
  template <bool kBf16>
  static __device__ __forceinline__ void Half(float (&d)[4], const uint32_t (&a)[4], uint64_t desc_b,
                                            uint32_t scale_d) {
    if constexpr (kBf16) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
          "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
    } else {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 "
          "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
    }
  }
  // D[64 x N] += A[64 x 16] (16-bit, shared memory, MN-major) * B[16 x N] (16-bit, shared memory, K-major).
  template <bool kBf16>
  static __device__ __forceinline__ void Half(float (&d)[4], uint64_t desc_a, uint64_t desc_b) {
    if constexpr (kBf16) {
      asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, 1, 1, 1, 1, 0;\n"
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                   : "l"(desc_a), "l"(desc_b));
    } else {
      asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, %4, %5, 1, 1, 1, 1, 0;\n"
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                   : "l"(desc_a), "l"(desc_b));
    }
  }
};

template <>
struct Wgmma<16> {
  // D[64 x N] (+)= A[64 x 32] (e4m3, registers) * B[32 x N] (e4m3, shared memory, K-major).
  static __device__ __forceinline__ void E4m3(float (&d)[8], const uint32_t* a, uint64_t desc_b, uint32_t scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, "
        "{%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
  }
  // D[64 x N] (+)= A[64 x 16] (16-bit, registers) * B[16 x N] (16-bit, shared memory, K-major).
  template <bool kBf16>
  static __device__ __forceinline__ void Half(float (&d)[8], const uint32_t (&a)[4], uint64_t desc_b,
                                            uint32_t scale_d) {
    if constexpr (kBf16) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
    } else {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
    }
  }
  // D[64 x N] += A[64 x 16] (16-bit, shared memory, MN-major) * B[16 x N] (16-bit, shared memory, K-major).
  template <bool kBf16>
  static __device__ __forceinline__ void Half(float (&d)[8], uint64_t desc_a, uint64_t desc_b) {
    if constexpr (kBf16) {
      asm volatile(
          "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, 1, 1, 1, 1, 0;\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
          : "l"(desc_a), "l"(desc_b));
    } else {
      asm volatile(
          "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, 1, 1, 1, 1, 0;\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
          : "l"(desc_a), "l"(desc_b));
    }
  }
};

template <>
struct Wgmma<32> {
  static __device__ __forceinline__ void E4m3(float (&d)[16], const uint32_t* a, uint64_t desc_b, uint32_t scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
  }
  // D[64 x N] (+)= A[64 x 16] (16-bit, registers) * B[16 x N] (16-bit, shared memory, K-major).
  template <bool kBf16>
  static __device__ __forceinline__ void Half(float (&d)[16], const uint32_t (&a)[4], uint64_t desc_b,
                                            uint32_t scale_d) {
    if constexpr (kBf16) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
            "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
    } else {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
            "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
    }
  }
  template <bool kBf16>
  static __device__ __forceinline__ void Half(float (&d)[16], uint64_t desc_a, uint64_t desc_b) {
    if constexpr (kBf16) {
      asm volatile(
          "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, 1, 1, 1, 1, 0;\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
            "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
          : "l"(desc_a), "l"(desc_b));
    } else {
      asm volatile(
          "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, 1, 1, 1, 1, 0;\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
            "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
          : "l"(desc_a), "l"(desc_b));
    }
  }
};

#define JAX_W4A4_D32                                                                                             \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),   \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),    \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),   \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define JAX_W4A4_D32_LIST                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"

template <>
struct Wgmma<64> {
  // D[64 x N] (+)= A[64 x 16] (16-bit, registers) * B[16 x N] (16-bit, shared memory, K-major).
  template <bool kBf16>
  static __device__ __forceinline__ void Half(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                            uint32_t scale_d) {
    if constexpr (kBf16) {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " JAX_W4A4_D32_LIST
                   ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                   : JAX_W4A4_D32
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
    } else {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " JAX_W4A4_D32_LIST
                   ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                   : JAX_W4A4_D32
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
    }
  }
  static __device__ __forceinline__ void E4m3(float (&d)[32], const uint32_t* a, uint64_t desc_b, uint32_t scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " JAX_W4A4_D32_LIST
        ", {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
        : JAX_W4A4_D32
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
  }
  template <bool kBf16>
  static __device__ __forceinline__ void Half(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
    if constexpr (kBf16) {
      asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " JAX_W4A4_D32_LIST
                   ", %32, %33, 1, 1, 1, 1, 0;\n"
                   : JAX_W4A4_D32
                   : "l"(desc_a), "l"(desc_b));
    } else {
      asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " JAX_W4A4_D32_LIST
                   ", %32, %33, 1, 1, 1, 1, 0;\n"
                   : JAX_W4A4_D32
                   : "l"(desc_a), "l"(desc_b));
    }
  }
};

#undef JAX_W4A4_D32
#undef JAX_W4A4_D32_LIST

}  // namespace jax_w4a4::sm90
