// Decoding and validation of the W4A4 FFI calls, shared by their handlers: `jax_w4a4_act_quant` and
// `jax_w4a4_w4a4_gemm` each launch one kernel; `jax_w4a4_w4a4_linear` launches both with the same checks.
#pragma once

#include <cstdint>
#include <string_view>

#include "common/ffi_util.h"
#include "kernels/sm90/act_quant.h"
#include "kernels/sm90/w4a4_gemm.h"

namespace jax_w4a4 {

// The launch arguments of act_quant from its buffers (docs/layouts.md, act_quant), or the violated rule.
ffi::Error ActQuantArgsFrom(ffi::AnyBuffer x, ffi::AnyBuffer smooth, ffi::AnyBuffer lora_down, ffi::AnyBuffer q,
                            ffi::AnyBuffer scales, ffi::AnyBuffer la, ffi::AnyBuffer workspace,
                            std::string_view act_format, int64_t num_sms, sm90::ActQuantArgs& args);

// The launch arguments of the W4A4 GEMM from its buffers (docs/layouts.md, w4a4_gemm), or the violated rule.
ffi::Error W4a4GemmArgsFrom(ffi::AnyBuffer q_x, ffi::AnyBuffer s_x, ffi::AnyBuffer la, ffi::AnyBuffer qweight,
                            ffi::AnyBuffer wscales, ffi::AnyBuffer lora_up, ffi::AnyBuffer alpha, ffi::AnyBuffer bias,
                            ffi::AnyBuffer y, ffi::AnyBuffer workspace, std::string_view act_format, int64_t num_sms,
                            sm90::W4A4GemmSm90Args& args);

}  // namespace jax_w4a4
