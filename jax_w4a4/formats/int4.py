"""4-bit nibble packing and the group-wise int4 quantizer shared by the svdq and w4a16 formats.

Packing (``docs/layouts.md``): two values per byte along the last axis, element ``2i`` in the low
nibble and ``2i+1`` in the high nibble; signed values are two's-complement nibbles.

This module also holds the package's shared helpers: the IEEE division every quantizer uses
(:func:`div_rn`, :func:`divide_by_scale`), rounding onto an integer grid (:func:`round_to_grid`), the
scale-dtype check, and the ``(..., K) <-> (..., K/G, G)`` group view and group-wise scaling.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike, DTypeLike

SCALE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def div_rn(a: ArrayLike, b: ArrayLike) -> jax.Array:
    """``a / b`` in fp32, correctly rounded (IEEE division, CUDA ``__fdiv_rn``), with broadcasting.

    XLA's algebraic simplifier rewrites ``a / broadcast(b)`` into ``a * broadcast(1 / b)``, which is not
    correctly rounded (it changes about half of the quotients by one ulp). The divisor is therefore
    broadcast to the full shape behind an optimization barrier, so a true division is emitted.
    """
    a = jnp.asarray(a).astype(jnp.float32)
    b = jnp.asarray(b).astype(jnp.float32)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    return jnp.broadcast_to(a, shape) / lax.optimization_barrier(jnp.broadcast_to(b, shape))


def divide_by_scale(x: ArrayLike, scale: ArrayLike) -> jax.Array:
    """``x / scale`` (:func:`div_rn`), and 0 wherever ``scale == 0`` (never NaN)."""
    scale = jnp.asarray(scale).astype(jnp.float32)
    zero = scale == 0
    return jnp.where(zero, 0.0, div_rn(x, jnp.where(zero, 1.0, scale)))


def round_to_grid(x: ArrayLike, scale: ArrayLike, zero: ArrayLike, lo: int, hi: int) -> jax.Array:
    """``clip(rne(x / scale) + zero, lo, hi)`` as int8; ``scale == 0`` gives ``zero``."""
    q = jnp.round(divide_by_scale(x, scale)) + jnp.asarray(zero).astype(jnp.float32)
    return jnp.clip(q, lo, hi).astype(jnp.int8)


def check_scale_dtype(scale_dtype: DTypeLike) -> jnp.dtype:
    """The scale dtype as a ``jnp.dtype``; ValueError unless it is bfloat16 or float16."""
    try:
        dtype = jnp.dtype(scale_dtype)
    except TypeError:
        dtype = None
    if dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be bfloat16 or float16, got {scale_dtype!r}")
    return dtype


def split_groups(x: jax.Array, group_size: int, arg: str) -> jax.Array:
    """View ``(..., K)`` as ``(..., K/group_size, group_size)``; ValueError naming ``arg`` otherwise."""
    if x.ndim < 1 or x.shape[-1] % group_size:
        raise ValueError(
            f"{arg}: the last dimension must be a multiple of the group size {group_size}, "
            f"got shape {tuple(x.shape)}"
        )
    return x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)


def _multiply_fp32(values: jax.Array, scales: jax.Array) -> jax.Array:
    return values * scales.astype(jnp.float32)


def apply_group_scales(
    values: jax.Array,
    scales: ArrayLike,
    group_size: int,
    values_arg: str,
    scales_arg: str,
    scale_fn: Callable[[jax.Array, jax.Array], jax.Array] = _multiply_fp32,
) -> jax.Array:
    """Scale fp32 ``values (..., K)`` group-wise by ``scales (..., K/group_size)``.

    ``scale_fn(groups, scales[..., None])`` does the scaling (default: fp32 multiply); shapes are
    checked, with ValueErrors naming ``values_arg`` / ``scales_arg``.
    """
    groups = split_groups(values.astype(jnp.float32), group_size, values_arg)
    scales = jnp.asarray(scales)
    if scales.shape != groups.shape[:-1]:
        raise ValueError(
            f"{scales_arg} must have shape {tuple(groups.shape[:-1])} (one scale per {group_size} "
            f"values of {values_arg}), got {tuple(scales.shape)}"
        )
    return scale_fn(groups, scales[..., None]).reshape(values.shape)


def pack_int4(q: ArrayLike) -> jax.Array:
    """Pack 4-bit values ``(..., 2n)`` into uint8 ``(..., n)``: element 2i low nibble, 2i+1 high.

    ``q`` is any integer dtype holding −8..7 (stored as two's-complement nibbles) or 0..15; values
    outside both ranges are not checked (only their low 4 bits are kept).
    """
    q = jnp.asarray(q)
    if not jnp.issubdtype(q.dtype, jnp.integer):
        raise ValueError(f"q must have an integer dtype (e.g. int8, uint8, int32), got {q.dtype}")
    if q.ndim < 1 or q.shape[-1] % 2:
        raise ValueError(f"q: the last dimension must be even, got shape {tuple(q.shape)}")
    nibbles = (split_groups(q, 2, "q") & 0xF).astype(jnp.uint8)
    return nibbles[..., 0] | (nibbles[..., 1] << 4)


def unpack_int4(packed: ArrayLike, *, signed: bool) -> jax.Array:
    """Unpack uint8 ``(..., n)`` into int8 ``(..., 2n)``: −8..7 if ``signed`` else 0..15."""
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise ValueError(f"packed must have dtype uint8, got {packed.dtype}")
    if packed.ndim < 1:
        raise ValueError(f"packed must have at least one dimension, got shape {tuple(packed.shape)}")
    nibbles = jnp.stack([packed & 0xF, packed >> 4], axis=-1).astype(jnp.int8)
    nibbles = nibbles.reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    return (nibbles ^ 8) - 8 if signed else nibbles


def quantize_int4_groups(
    x: ArrayLike, group_size: int, scale_dtype: DTypeLike, *, unsigned: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Symmetric absmax int4 quantization per group of ``group_size`` along the last axis.

    ``scale = absmax / 7`` (signed, q in −8..7) or ``absmax / 15`` (``unsigned``, q in 0..15), computed
    in fp32 and rounded to ``scale_dtype``; the rounded scale is the one used:
    ``q = clip(rne(fp32(x) / scale), lo, hi)`` (IEEE division), and ``scale == 0`` gives ``q = 0``.
    Unsigned inputs must be ≥ 0: a negative value saturates to 0.

    Returns ``(q, scales)``: int8 ``(..., K)`` unpacked values and ``(..., K/group_size)`` scales.
    """
    scale_dtype = check_scale_dtype(scale_dtype)
    x = jnp.asarray(x).astype(jnp.float32)
    groups = split_groups(x, group_size, "x")
    lo, hi = (0, 15) if unsigned else (-8, 7)
    scales = div_rn(jnp.max(jnp.abs(groups), axis=-1), hi).astype(scale_dtype)
    q = round_to_grid(groups, scales[..., None], 0, lo, hi)
    return q.reshape(x.shape), scales
