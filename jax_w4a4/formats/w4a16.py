"""w4a16 weights (GPTQ / AWQ / MARLIN semantics): ``Ŵ[n,k] = (q[n,k] − z[n,g(k)]) · s[n,g(k)]``.

q is uint4 (0..15) packed two per byte, one scale (and, for zero-point, one uint4 zero stored one per
byte) per row and group. Symmetric (GPTQ): ``s = 2·absmax/15``, ``z = 8``. Zero-point (AWQ):
``s = (max − min)/15`` over the group widened to include 0, ``z = clip(rne(−min/s), 0, 15)``.
Scales are computed in fp32 and rounded to bf16/fp16 before use; ``s == 0`` gives ``q = z`` (and
``z = 0`` for zero-point). Act-order: ``g_idx (K,)`` names the group of every column.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from jax_w4a4.formats.int4 import (
    check_scale_dtype,
    div_rn,
    divide_by_scale,
    pack_int4,
    round_to_grid,
    unpack_int4,
)

GROUP_SIZES = (32, 64, 128, -1)
SYMMETRIC_ZERO = 8


class W4A16Quantized(NamedTuple):
    """``qweight`` uint8 ``(N, K/2)``, ``scales`` ``(N, G)``, ``zeros`` uint8 ``(N, G)`` or None."""

    qweight: jax.Array
    scales: jax.Array
    zeros: jax.Array | None


def n_groups(k: int, group_size: int) -> int:
    """Number of groups along ``k``; ``group_size`` is 32, 64, 128, or -1 (or k itself) for per-channel."""
    if group_size in (-1, k):
        return 1
    if group_size not in GROUP_SIZES:
        raise ValueError(
            f"group_size must be one of {GROUP_SIZES} (-1 or K: per channel), got {group_size!r}"
        )
    if k % group_size:
        raise ValueError(f"K={k} must be a multiple of group_size={group_size}")
    return k // group_size


def _group_of_column(k: int, group_size: int, g_idx: ArrayLike | None) -> tuple[jax.Array, int]:
    """``(g (K,) int32, number of groups)``: g_idx when given, else contiguous groups."""
    groups = n_groups(k, group_size)
    if g_idx is None:
        return jnp.arange(k, dtype=jnp.int32) // (k // groups), groups
    g_idx = jnp.asarray(g_idx)
    if g_idx.shape != (k,) or not jnp.issubdtype(g_idx.dtype, jnp.integer):
        raise ValueError(
            f"g_idx must be an integer array of shape ({k},), got {g_idx.dtype}{tuple(g_idx.shape)}"
        )
    return g_idx.astype(jnp.int32), groups


def _group_reduce(w: jax.Array, g: jax.Array, groups: int, *, contiguous: bool, smallest: bool) -> jax.Array:
    """Per-(row, group) min or max of ``w (N, K)`` -> ``(N, groups)``; an empty group gives 0.

    No scatter (segment_min/max lower to scatters, which XLA GPU fails to launch at 28672 x 8192):
    contiguous groups are a reshape; act-order groups are made contiguous by a stable sort of the
    columns, reduced with a segmented scan, and read at each group's last column.
    """
    reduce = jnp.minimum if smallest else jnp.maximum
    n, k = w.shape
    if contiguous:
        return (jnp.min if smallest else jnp.max)(w.reshape(n, groups, k // groups), axis=-1)
    order = jnp.argsort(g, stable=True)
    g_sorted, w_sorted = g[order], w[:, order]
    starts = jnp.concatenate([jnp.ones((1,), bool), g_sorted[1:] != g_sorted[:-1]])

    def combine(a, b):
        (start_a, value_a), (start_b, value_b) = a, b
        return start_a | start_b, jnp.where(start_b, value_b, reduce(value_a, value_b))

    _, running = jax.lax.associative_scan(combine, (jnp.broadcast_to(starts, w.shape), w_sorted), axis=1)
    last = jnp.searchsorted(g_sorted, jnp.arange(groups, dtype=g_sorted.dtype), side="right") - 1
    present = (last >= 0) & (g_sorted[jnp.maximum(last, 0)] == jnp.arange(groups))
    return jnp.where(present, running[:, jnp.maximum(last, 0)], 0.0)


def quantize(
    w: ArrayLike,
    *,
    group_size: int,
    zero_point: bool,
    scale_dtype: DTypeLike,
    g_idx: ArrayLike | None = None,
) -> W4A16Quantized:
    """Round-to-nearest quantization of ``w (N, K)`` (module docstring has the rules).

    With ``g_idx`` (int32 ``(K,)``, values in ``[0, n_groups(K, group_size))``), group g is the set of
    columns with ``g_idx == g`` (act-order); an empty group gets scale 0.
    """
    scale_dtype = check_scale_dtype(scale_dtype)
    w = jnp.asarray(w).astype(jnp.float32)
    if w.ndim != 2 or w.shape[1] % 2:
        raise ValueError(f"w must be 2-D (N, K) with K even, got shape {tuple(w.shape)}")
    g, groups = _group_of_column(w.shape[1], group_size, g_idx)
    # Group extremes widened to include 0 (an empty group reduces to 0).
    wmin = jnp.minimum(_group_reduce(w, g, groups, contiguous=g_idx is None, smallest=True), 0.0)
    wmax = jnp.maximum(_group_reduce(w, g, groups, contiguous=g_idx is None, smallest=False), 0.0)
    if zero_point:
        scales = div_rn(wmax - wmin, 15).astype(scale_dtype)
        zeros = jnp.clip(jnp.round(divide_by_scale(-wmin, scales)), 0, 15).astype(jnp.uint8)
        zero_of_column = zeros[:, g]
    else:
        scales = div_rn(2 * jnp.maximum(wmax, -wmin), 15).astype(scale_dtype)
        zeros, zero_of_column = None, SYMMETRIC_ZERO
    q = round_to_grid(w, scales[:, g], zero_of_column, 0, 15)
    return W4A16Quantized(pack_int4(q), scales, zeros)


def dequantize(
    qweight: ArrayLike,
    scales: ArrayLike,
    zeros: ArrayLike | None,
    *,
    group_size: int,
    g_idx: ArrayLike | None = None,
) -> jax.Array:
    """``(q − z[n, g(k)]) · s[n, g(k)]`` in fp32 ``(N, K)``; ``z = 8`` when ``zeros`` is None."""
    qweight = jnp.asarray(qweight)
    if qweight.ndim != 2:
        raise ValueError(f"qweight must be 2-D (N, K/2), got shape {tuple(qweight.shape)}")
    q = unpack_int4(qweight, signed=False)
    n, k = q.shape
    g, groups = _group_of_column(k, group_size, g_idx)
    scales = jnp.asarray(scales)
    if scales.shape != (n, groups):
        raise ValueError(f"scales must have shape {(n, groups)}, got {tuple(scales.shape)}")
    if zeros is None:
        zero_of_column = jnp.float32(SYMMETRIC_ZERO)
    else:
        zeros = jnp.asarray(zeros)
        if zeros.shape != (n, groups) or zeros.dtype != jnp.uint8:
            raise ValueError(
                f"zeros must be uint8 of shape {(n, groups)}, got {zeros.dtype}{tuple(zeros.shape)}"
            )
        zero_of_column = zeros[:, g].astype(jnp.float32)
    return (q.astype(jnp.float32) - zero_of_column) * scales.astype(jnp.float32)[:, g]
