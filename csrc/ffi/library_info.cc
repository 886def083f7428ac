// What this build of libjax_w4a4.so contains, readable from Python through ctypes: the FFI targets
// compiled in (so Python can check its lowering table against the binary); and the state it keeps on the
// device, for tests.
#include <cstdint>

#include "common/ffi_util.h"
#include "kernels/sm90/act_quant.h"
#include "kernels/sm90/w4a16_gemm.h"
#include "kernels/sm90/w4a4_gemm.h"

extern "C" __attribute__((visibility("default"))) const char* JaxW4a4Targets() {
  return "jax_w4a4_act_quant,jax_w4a4_w4a4_gemm,jax_w4a4_w4a4_linear,jax_w4a4_w4a16_gemm,jax_w4a4_device_clock,jax_w4a4_stream_peer";
}

// The arrival counters (common/arrival_counters.h) of all kernels on the current device that are not zero
// (every launch must leave them at 0), or -1 when a pool cannot be read. Synchronizes the device.
extern "C" __attribute__((visibility("default"))) int64_t JaxW4a4ArmedArrivalCounters() {
  const int64_t pools[] = {jax_w4a4::sm90::ActQuantArmedCounters(), jax_w4a4::sm90::w4a16::W4a16ArmedCounters(),
                           jax_w4a4::sm90::W4A4GemmArmedCounters()};
  int64_t armed = 0;
  for (int64_t count : pools) {
    if (count < 0) return -1;
    armed += count;
  }
  return armed;
}
