"""svdq int4 (W4A4, Nunchaku INT4 semantics): absmax int4 per group of 64 along K.

Weights: ``s = absmax / 7`` in bf16/fp16, q in −8..7. Activations: the same (signed) or, for
non-negative inputs, ``s = absmax / 15`` with q in 0..15. Values are packed two per byte
(:func:`jax_w4a4.formats.int4.pack_int4`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from jax_w4a4.formats.fp8 import from_e4m3_bits, to_e4m3_bits
from jax_w4a4.formats.int4 import apply_group_scales, pack_int4, quantize_int4_groups, unpack_int4

GROUP_SIZE = 64


def quantize_weights(w: ArrayLike, *, scale_dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
    """Quantize the residual ``w (N, K)`` to ``(qweight uint8 (N, K/2), wscales (N, K/64))``."""
    w = jnp.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D (N, K), got shape {tuple(w.shape)}")
    q, scales = quantize_int4_groups(w, GROUP_SIZE, scale_dtype)
    return pack_int4(q), scales


def quantize_activations(
    x_hat_f32: ArrayLike, *, scale_dtype: DTypeLike, unsigned: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Quantize smoothed activations ``(..., K)`` to ``(q uint8 (..., K/2), scales (..., K/64))``.

    ``unsigned`` selects the uint4 variant for non-negative inputs (negative values saturate to 0).
    """
    q, scales = quantize_int4_groups(x_hat_f32, GROUP_SIZE, scale_dtype, unsigned=unsigned)
    return pack_int4(q), scales


def dequantize(packed: ArrayLike, scales: ArrayLike, *, signed: bool) -> jax.Array:
    """``q · s`` in fp32 ``(..., K)`` from packed ``(..., K/2)`` values and ``(..., K/64)`` scales."""
    values = unpack_int4(packed, signed=signed)
    return apply_group_scales(values, scales, GROUP_SIZE, "packed (2 values per byte)", "scales")


def to_e4m3_codes(packed: ArrayLike, *, signed: bool) -> jax.Array:
    """Packed activations ``(..., K/2)`` → the kernel layout: one e4m3 code per value ``(..., K)``.

    The int4 / uint4 values are integers, exact in e4m3, so the GEMM reads them as FP8 tensor-core
    operands directly.
    """
    return to_e4m3_bits(unpack_int4(packed, signed=signed).astype(jnp.float32))


def from_e4m3_codes(codes: ArrayLike) -> jax.Array:
    """The kernel layout ``(..., K)`` e4m3 codes of int4/uint4 values → packed ``(..., K/2)`` (bit-exact)."""
    return pack_int4(from_e4m3_bits(codes, "codes").astype(jnp.int8))
