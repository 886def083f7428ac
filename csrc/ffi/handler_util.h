// Helpers shared by the FFI handlers: dtype names, shape descriptions, and the checks every handler
// makes of activation-like buffers and optional per-column vectors (docs/layouts.md conventions).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/arrival_counters.h"
#include "common/ffi_util.h"
#include "kernels/sm90/act_quant.h"

namespace jax_w4a4 {

inline bool ParseActFormat(std::string_view name, sm90::ActFormat& format) {
  if (name == "int4") {
    format = sm90::ActFormat::kInt4;
  } else if (name == "uint4") {
    format = sm90::ActFormat::kUint4;
  } else if (name == "fp8") {
    format = sm90::ActFormat::kFp8;
  } else {
    return false;
  }
  return true;
}

inline const char* DtypeName(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::BF16: return "bf16";
    case ffi::DataType::F16: return "fp16";
    case ffi::DataType::F32: return "fp32";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::S32: return "int32";
    default: return "another dtype";
  }
}

inline std::string DimsString(const ffi::AnyBuffer& buffer) {
  std::string s = "(";
  auto dims = buffer.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

inline std::string Describe(const ffi::AnyBuffer& buffer) {
  return DimsString(buffer) + " " + DtypeName(buffer.element_type());
}

// `buffer` must have the leading dims of `lead`, last dim `last` and dtype `dtype`.
inline ffi::Error CheckActivationLike(std::string_view op, const ffi::AnyBuffer& buffer, const ffi::AnyBuffer& lead,
                                      const char* lead_name, int64_t last, ffi::DataType dtype, const char* name) {
  auto lead_dims = lead.dimensions();
  auto dims = buffer.dimensions();
  bool ok = buffer.element_type() == dtype && dims.size() == lead_dims.size() && dims.size() > 0 &&
            dims[dims.size() - 1] == last;
  for (size_t i = 0; ok && i + 1 < dims.size(); ++i) ok = dims[i] == lead_dims[i];
  if (!ok) {
    return Invalid(op, std::string(name) + " must have " + lead_name + "'s leading dims, last dim " +
                           std::to_string(last) + " and dtype " + DtypeName(dtype) + "; got " + Describe(buffer));
  }
  return ffi::Error::Success();
}

// An optional per-column vector: (n,) of `dtype`, or (0,) when absent (then `data` is nullptr).
inline ffi::Error OptionalVector(std::string_view op, const ffi::AnyBuffer& buffer, int64_t n, ffi::DataType dtype,
                                 const char* name, const void*& data) {
  auto dims = buffer.dimensions();
  data = nullptr;
  if (dims.size() == 1 && dims[0] == 0) return ffi::Error::Success();
  if (dims.size() != 1 || dims[0] != n || buffer.element_type() != dtype) {
    return Invalid(op, std::string(name) + " must be (" + std::to_string(n) + ",) " + DtypeName(dtype) +
                           " or (0,) when absent; got " + Describe(buffer));
  }
  data = buffer.untyped_data();
  return ffi::Error::Success();
}

// The XLA-allocated workspace result of a kernel that plans its launch for `num_sms` SMs: the attribute
// in range, then `workspace` a 16-byte aligned uint8 vector of at least `needed` bytes (sized at lowering
// by the same plan, jax_w4a4/ops/primitives.py).
inline ffi::Error CheckNumSms(std::string_view op, int64_t num_sms) {
  if (num_sms < 1 || num_sms > kMaxNumSms) {
    return Invalid(op, "num_sms must be in [1, " + std::to_string(kMaxNumSms) + "], got " + std::to_string(num_sms));
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckWorkspace(std::string_view op, const ffi::AnyBuffer& workspace, int64_t needed) {
  if (workspace.element_type() != ffi::DataType::U8 || workspace.dimensions().size() != 1 ||
      static_cast<int64_t>(workspace.size_bytes()) < needed ||
      reinterpret_cast<uintptr_t>(workspace.untyped_data()) % 16 != 0) {
    return Invalid(op, "workspace must be 16-byte aligned uint8 (>= " + std::to_string(needed) + ",), got " +
                           DimsString(workspace));
  }
  return ffi::Error::Success();
}

}  // namespace jax_w4a4
