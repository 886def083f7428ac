// Launcher of the device clock (device_clock.cu): the GPU global timer, in ns, written to `out`.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_w4a4 {

cudaError_t LaunchReadGlobalTimer(uint64_t* out, cudaStream_t stream);

}  // namespace jax_w4a4
