// Launcher of the stream peer (stream_peer.cu): the high byte of every 16-bit value of `x`, written to `out`.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_w4a4 {

inline constexpr int64_t kStreamPeerValueGranule = 16;  // values per thread step: 32 bytes in, 16 out

// `values` 16-bit values at `x` (16-byte aligned) -> `values` bytes at `out`; values % kStreamPeerValueGranule == 0.
cudaError_t LaunchStreamPeer(const void* x, void* out, int64_t values, cudaStream_t stream);

}  // namespace jax_w4a4
