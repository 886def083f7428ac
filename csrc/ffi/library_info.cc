// What this build of libjax_w4a4.so contains, readable from Python through ctypes: the FFI targets
// compiled in (so Python can check its lowering table against the binary).
#include "common/ffi_util.h"

extern "C" __attribute__((visibility("default"))) const char* JaxW4a4Targets() {
  return "jax_w4a4_act_quant,jax_w4a4_w4a4_gemm,jax_w4a4_w4a16_gemm,jax_w4a4_device_clock";
}
