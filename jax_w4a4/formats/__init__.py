"""Number formats: 4-bit packing, svdq int4, fp8 (w4a8), w4a16 (GPTQ/AWQ), nvfp4 and mxfp4.

Pure JAX, jit-able, backend independent; the executable byte contract of ``docs/layouts.md``.
Modules with same-named functions (``quantize_activations``, ``dequantize``) are used qualified:
``formats.svdq.quantize_weights``, ``formats.fp8.quantize_activations``, ``formats.w4a16.quantize``.
"""

from jax_w4a4.formats import fp4, fp8, int4, svdq, w4a16
from jax_w4a4.formats.fp4 import (
    decode_e2m1,
    dequantize_mxfp4,
    dequantize_nvfp4,
    encode_e2m1,
    quantize_mxfp4,
    quantize_nvfp4,
)
from jax_w4a4.formats.int4 import div_rn, pack_int4, quantize_int4_groups, unpack_int4
from jax_w4a4.formats.w4a16 import W4A16Quantized

__all__ = [
    "W4A16Quantized",
    "decode_e2m1",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "div_rn",
    "encode_e2m1",
    "fp4",
    "fp8",
    "int4",
    "pack_int4",
    "quantize_int4_groups",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "svdq",
    "unpack_int4",
    "w4a16",
]
