"""w4a8 activations: fp8 e4m3 values with one fp32 scale per group of 128 along K.

``scale = absmax / 448`` (fp32), ``q = e4m3(rne(x / scale))`` saturating to ±448; an all-zero group has
scale 0 and q = 0. Values travel as uint8 holding the float8_e4m3fn bit patterns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jax_w4a4.formats.int4 import apply_group_scales, div_rn, divide_by_scale, split_groups

GROUP_SIZE = 128
E4M3_MAX = 448.0


def to_e4m3_bits(x_f32: ArrayLike) -> jax.Array:
    """fp32 → float8_e4m3fn bit patterns (uint8), round-half-to-even, saturating to ±448."""
    x = jnp.clip(jnp.asarray(x_f32).astype(jnp.float32), -E4M3_MAX, E4M3_MAX)
    return lax.bitcast_convert_type(x.astype(jnp.float8_e4m3fn), jnp.uint8)


def from_e4m3_bits(bits: ArrayLike, arg: str = "bits") -> jax.Array:
    """float8_e4m3fn bit patterns (uint8) → fp32 (exact); ``arg`` names the operand in errors."""
    bits = jnp.asarray(bits)
    if bits.dtype != jnp.uint8:
        raise ValueError(f"{arg} must have dtype uint8 (float8_e4m3fn bit patterns), got {bits.dtype}")
    return lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32)


def quantize_activations(x_f32: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """Quantize ``(..., K)`` to ``(q uint8 (..., K) e4m3 bits, scales fp32 (..., K/128))``."""
    x = jnp.asarray(x_f32).astype(jnp.float32)
    groups = split_groups(x, GROUP_SIZE, "x_f32")
    scales = div_rn(jnp.max(jnp.abs(groups), axis=-1), E4M3_MAX)
    q = to_e4m3_bits(divide_by_scale(groups, scales[..., None]))
    return q.reshape(x.shape), scales


def dequantize(q: ArrayLike, scales: ArrayLike) -> jax.Array:
    """``e4m3(q) · scale`` in fp32 ``(..., K)``: uint8 ``q (..., K)``, fp32 ``scales (..., K/128)``."""
    return apply_group_scales(from_e4m3_bits(q, "q"), scales, GROUP_SIZE, "q", "scales")
