"""FP4 e2m1 values with block scales: nvfp4 (e4m3 per 16 × fp32 tensor scale) and mxfp4 (OCP MX v1.0,
e8m0 per 32).

e2m1 magnitudes are ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``; a code is ``sign << 3 | magnitude index``.
Encoding rounds half to even on that grid (even index = even mantissa) and saturates to ±6; the sign
of the input is kept, so a small negative value encodes as −0 (code 8). Codes are packed two per byte
with :func:`jax_w4a4.formats.int4.pack_int4`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jax_w4a4.formats.fp8 import E4M3_MAX, from_e4m3_bits, to_e4m3_bits
from jax_w4a4.formats.int4 import (
    apply_group_scales,
    div_rn,
    divide_by_scale,
    pack_int4,
    split_groups,
    unpack_int4,
)

E2M1_MAX = 6.0
E2M1_EMAX = 2  # floor(log2(E2M1_MAX))
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
E8M0_BIAS = 127

_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(_E2M1_MAGNITUDES, _E2M1_MAGNITUDES[1:]))


def encode_e2m1(x_f32: ArrayLike) -> jax.Array:
    """fp32 → e2m1 codes (uint8, 0..15): round half to even on the e2m1 grid, saturating to ±6."""
    x = jnp.asarray(x_f32).astype(jnp.float32)
    magnitude = jnp.abs(x)[..., None]
    midpoints = jnp.asarray(_E2M1_MIDPOINTS, jnp.float32)
    # Crossing midpoint i moves from index i to i+1; a tie stays at i when i is even, else goes up.
    tie_goes_up = jnp.arange(len(_E2M1_MIDPOINTS)) % 2 == 1
    crossed = jnp.where(tie_goes_up, magnitude >= midpoints, magnitude > midpoints)
    index = jnp.sum(crossed, axis=-1, dtype=jnp.uint8)
    return (jnp.signbit(x).astype(jnp.uint8) << 3) | index


def decode_e2m1(codes: ArrayLike) -> jax.Array:
    """e2m1 codes (integer, 0..15) → fp32 values (exact)."""
    codes = jnp.asarray(codes)
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise ValueError(f"codes must have an integer dtype, got {codes.dtype}")
    table = jnp.asarray(_E2M1_MAGNITUDES + tuple(-m for m in _E2M1_MAGNITUDES), jnp.float32)
    return table[codes & 0xF]


def quantize_nvfp4(x: ArrayLike) -> tuple[jax.Array, jax.Array, jax.Array]:
    """nvfp4 quantization of ``(..., K)``, K a multiple of 16.

    ``tensor_scale = amax(x) / (6·448)`` (1.0 when x is all zero); per block of 16,
    ``block_scale = e4m3(amax_block / 6 / tensor_scale)`` and
    ``codes = e2m1(x / (fp32(block_scale) · tensor_scale))`` (a zero block scale gives zero codes).
    All arithmetic is fp32 with IEEE divisions.

    Returns ``(packed uint8 (..., K/2), block_scales uint8 (..., K/16) e4m3 bits, tensor_scale fp32 ())``.
    """
    x = jnp.asarray(x).astype(jnp.float32)
    blocks = split_groups(x, NVFP4_BLOCK, "x")
    amax = jnp.max(jnp.abs(x))
    tensor_scale = jnp.where(amax == 0, 1.0, div_rn(amax, E2M1_MAX * E4M3_MAX))
    block_amax = jnp.max(jnp.abs(blocks), axis=-1)
    block_scales = to_e4m3_bits(div_rn(div_rn(block_amax, E2M1_MAX), tensor_scale))
    scale = from_e4m3_bits(block_scales) * tensor_scale
    codes = encode_e2m1(divide_by_scale(blocks, scale[..., None]))
    return pack_int4(codes.reshape(x.shape)), block_scales, tensor_scale


def dequantize_nvfp4(packed: ArrayLike, block_scales: ArrayLike, tensor_scale: ArrayLike) -> jax.Array:
    """``e2m1 · (fp32(block_scale) · tensor_scale)`` in fp32 ``(..., K)``."""
    values = decode_e2m1(unpack_int4(packed, signed=False))
    scale = from_e4m3_bits(block_scales, "block_scales") * jnp.asarray(tensor_scale).astype(jnp.float32)
    return apply_group_scales(values, scale, NVFP4_BLOCK, "packed (2 values per byte)", "block_scales")


def _pow2(exponent: jax.Array) -> jax.Array:
    """Exactly ``2**exponent`` in fp32 for integer exponents in [−126, 127] (normal numbers only)."""
    return lax.bitcast_convert_type((exponent + 127).astype(jnp.uint32) << 23, jnp.float32)


def _mul_pow2(x: jax.Array, exponent: jax.Array) -> jax.Array:
    """``x · 2**exponent`` exactly (as one IEEE multiply would round it), exponent in [−252, 252].

    The power of two is applied as two normal factors: a subnormal factor such as 2^−127 would be
    read as zero by backends that flush denormals (XLA on CPU does).
    """
    half = exponent // 2
    return x * _pow2(half) * _pow2(exponent - half)


def quantize_mxfp4(x: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """mxfp4 (OCP MX v1.0) quantization of ``(..., K)``, K a multiple of 32.

    Per block of 32: ``shared_exp = floor(log2(amax)) − 2`` clamped to [−127, 127] (an all-zero block
    gives −127), ``codes = e2m1(x / 2^shared_exp)`` saturating to ±6.

    Returns ``(packed uint8 (..., K/2), scales uint8 (..., K/32) e8m0 biased exponents)``.
    """
    x = jnp.asarray(x).astype(jnp.float32)
    blocks = split_groups(x, MXFP4_BLOCK, "x")
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    # floor(log2(amax)) exactly, from the fp32 exponent field. Zero and subnormal amax read as −127,
    # which clamps to the same shared exponent as their true floor(log2).
    biased = (lax.bitcast_convert_type(amax, jnp.uint32) >> 23).astype(jnp.int32)
    shared_exp = jnp.clip(biased - E8M0_BIAS - E2M1_EMAX, -E8M0_BIAS, E8M0_BIAS)
    # x / 2^e == x · 2^−e exactly (powers of two).
    codes = encode_e2m1(_mul_pow2(blocks, -shared_exp[..., None]))
    return pack_int4(codes.reshape(x.shape)), (shared_exp + E8M0_BIAS).astype(jnp.uint8)


def dequantize_mxfp4(packed: ArrayLike, scales: ArrayLike) -> jax.Array:
    """``e2m1 · 2^(scale − 127)`` in fp32 ``(..., K)``.

    e8m0 code 255 (NaN in the spec) is never produced by :func:`quantize_mxfp4` and is not decoded.
    """
    scales = jnp.asarray(scales)
    if scales.dtype != jnp.uint8:
        raise ValueError(f"scales must have dtype uint8 (e8m0 biased exponents), got {scales.dtype}")
    values = decode_e2m1(unpack_int4(packed, signed=False))
    return apply_group_scales(
        values,
        scales,
        MXFP4_BLOCK,
        "packed (2 values per byte)",
        "scales",
        lambda groups, codes: _mul_pow2(groups, codes.astype(jnp.int32) - E8M0_BIAS),
    )
