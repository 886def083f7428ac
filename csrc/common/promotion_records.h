// The W4A4 decode tiles' promotion records (w4a4_gemm_plan.h, W4A4PromotionRecordsBytes): per token and group of
// 64 the group's activation scale s and the cancellation of the weights' offset, c = -8·2^-9·S·s with S the sum
// of the group's code values. Formed by act_quant in the W4A4 linear and by the GEMM's PromotionRecordsKernel
// otherwise, with these functions: S is exact in fp32 in any order (64 e4m3 values are multiples of 2^-9 below
// 64 x 448 < 2^15 in magnitude) and c is one product, so both give the same bits.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace jax_w4a4 {

// Σ of the 16 e4m3 values in `codes` (byte order), each pair widened exactly through f16.
__device__ __forceinline__ float SumE4m3x16(const uint4& codes) {
  float sum = 0.0f;
  for (const uint32_t word : {codes.x, codes.y, codes.z, codes.w}) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2 pair = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(word >> (16 * h)), __NV_E4M3);
      const float2 values = __half22float2(pair);
      sum += values.x + values.y;
    }
  }
  return sum;
}

// A group's record from its code sum S and its activation scale s: (s, -8·2^-9·S·s).
__device__ __forceinline__ float2 PromotionRecord(float code_sum, float scale) {
  return make_float2(scale, -0x1p-6f * code_sum * scale);
}

}  // namespace jax_w4a4
