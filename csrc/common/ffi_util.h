// Shared helpers for the XLA FFI handlers: CUDA error -> ffi::Error, buffer shape checks.
// Handlers stay thin (decode, validate, launch); every check here is a second line of defence
// behind the abstract evaluation in jax_w4a4/ops, which rejects bad input at trace time.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace jax_w4a4 {

namespace ffi = xla::ffi;

inline ffi::Error CudaStatus(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorName(status) + " (" +
                              cudaGetErrorString(status) + ")");
}

// Call right after a kernel launch: reports launch-configuration errors without a host sync.
inline ffi::Error LaunchStatus(const char* kernel) { return CudaStatus(cudaGetLastError(), kernel); }

#define JAX_W4A4_RETURN_IF_ERROR(expr)        \
  do {                                        \
    ::xla::ffi::Error status_ = (expr);       \
    if (status_.failure()) return status_;    \
  } while (0)

// Product of all dims but the last: X may be (..., K).
inline int64_t LeadingRows(const ffi::AnyBuffer& buffer) {
  auto dims = buffer.dimensions();
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) rows *= dims[i];
  return rows;
}

inline int64_t LastDim(const ffi::AnyBuffer& buffer) {
  auto dims = buffer.dimensions();
  return dims.size() == 0 ? 1 : dims[dims.size() - 1];
}

inline ffi::Error Invalid(std::string_view op, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + message);
}

inline bool IsHalf(ffi::DataType t) { return t == ffi::DataType::BF16 || t == ffi::DataType::F16; }

}  // namespace jax_w4a4
