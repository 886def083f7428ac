// Host-side queries of the current CUDA device that the launchers share.
#pragma once

#include <cuda_runtime.h>

namespace jax_w4a4 {

// The current device's SM count into `sms`, or the failing query's error (`sms` then as it was).
inline cudaError_t CurrentDeviceSms(int& sms) {
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) status = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return status;
}

}  // namespace jax_w4a4
