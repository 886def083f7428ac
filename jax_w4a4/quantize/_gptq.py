"""GPTQ (Frantar et al., 2022): quantize W column by column, compensating each column's error on the
columns not yet quantized through the inverse Hessian of the layer's squared output error.

``H = 2 XᵀX / n`` from the calibration inputs; dead inputs (``H[k,k] = 0``) get ``H[k,k] = 1`` and
``W[:, k] = 0``; dampening adds ``damp · mean(diag H)`` to the diagonal; ``U`` is the upper Cholesky
factor of ``H⁻¹`` (``H⁻¹ = UᵀU``). For each column ``j`` in order::

    q_j = Q(w_j);  e_j = (w_j − q_j) / U[j, j];  w_{j'} −= e_j · U[j, j']   for j' > j

done in blocks of ``block_size`` columns (updates inside a block are immediate, the rest of W gets one
matrix product per block — the same arithmetic, reordered). A group's scale (and zero point) is chosen
when its first column comes up, from the group's *current* (error-compensated) columns, by the
format's own quantizer (:func:`jax_w4a4.formats.w4a16.quantize` for w4a16,
:func:`jax_w4a4.formats.int4.quantize_int4_groups` for the svdq residual), so the stored scales obey
exactly the format's rules and the result is bit-compatible with its dequantization.

Act-order processes the columns by decreasing ``diag(H)``; groups are then runs of ``group_size``
columns in that order, and ``g_idx[k] = (position of k in the order) // group_size`` (the GPTQ
convention the w4a16 kernel layout expects).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_w4a4.formats import svdq, w4a16
from jax_w4a4.formats.int4 import pack_int4, quantize_int4_groups, round_to_grid
from jax_w4a4.ops import checks
from jax_w4a4.quantize.calibration import Calibration, as_calibration
from jax_w4a4.reference import HIGHEST
from jax_w4a4.weights import W4A16Weights

DEFAULT_BLOCK_SIZE = 128
DEFAULT_DAMP = 0.01


@dataclasses.dataclass(frozen=True)
class GroupGrid:
    """The integer grid one group of columns is quantized onto, with the format's scale rules.

    ``kind``: ``"w4a16"`` (uint4, ``(q − z)·s``, symmetric z = 8 or zero points) or ``"svdq"``
    (int4 −8..7, ``q·s``, ``s = absmax/7``). ``group_size`` is the number of columns per group
    (K itself for per-channel). ``dtype`` is the scale dtype (bf16 / fp16).
    """

    kind: str
    group_size: int
    dtype: jnp.dtype
    zero_point: bool = False

    @property
    def bounds(self) -> tuple[int, int]:
        return (0, 15) if self.kind == "w4a16" else (-8, 7)

    def params(self, segment: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(scale, zero)`` fp32 ``(N,)`` of a group's current columns ``segment (N, group_size)``;
        the scale is already rounded to the scale dtype (the value the format stores)."""
        if self.kind == "w4a16":
            quantized = w4a16.quantize(segment, group_size=-1, zero_point=self.zero_point, scale_dtype=self.dtype)
            scale = quantized.scales[:, 0].astype(jnp.float32)
            if quantized.zeros is None:
                return scale, jnp.full_like(scale, w4a16.SYMMETRIC_ZERO)
            return scale, quantized.zeros[:, 0].astype(jnp.float32)
        _, scales = quantize_int4_groups(segment, segment.shape[1], self.dtype)
        scale = scales[:, 0].astype(jnp.float32)
        return scale, jnp.zeros_like(scale)

    def quantize(self, column: jax.Array, scale: jax.Array, zero: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(q int8, dequantized fp32)`` of one column, as the format rounds and dequantizes it."""
        q = round_to_grid(column, scale, zero, *self.bounds)
        return q, (q.astype(jnp.float32) - zero) * scale


class GPTQResult(NamedTuple):
    """GPTQ output in logical (unpacked, original column order) form.

    ``q``: int8 ``(N, K)`` integer values on the grid; ``scales``: ``(N, groups)`` in the scale dtype;
    ``zeros``: uint8 ``(N, groups)`` (w4a16 zero-point only) or None; ``g_idx``: int32 ``(K,)`` with
    act-order, else None.
    """

    q: jax.Array
    scales: jax.Array
    zeros: jax.Array | None
    g_idx: jax.Array | None


def _upper_cholesky_of_inverse(h: jax.Array, damp: float) -> jax.Array:
    """``U`` with ``(H + damp·mean(diag H)·I)⁻¹ = UᵀU`` (upper triangular), in fp32."""
    k = h.shape[0]
    eye = jnp.eye(k, dtype=jnp.float32)
    h = h + (damp * jnp.mean(jnp.diag(h))) * eye
    lower = jnp.linalg.cholesky(h)
    h_inv = jax.scipy.linalg.cho_solve((lower, True), eye)
    return jnp.linalg.cholesky(h_inv).T


@functools.partial(jax.jit, static_argnames=("grid", "block_size", "act_order"))
def _gptq(
    w: jax.Array, h: jax.Array, damp: jax.Array, *, grid: GroupGrid, block_size: int, act_order: bool
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Returns ``(q (N, K) int8, scales (N, groups) fp32, zeros (N, groups) fp32, perm (K,), ok)``,
    everything in the processing order (``perm``); ``ok`` is False when the Cholesky failed."""
    n, k = w.shape
    g = grid.group_size
    w = w.astype(jnp.float32)
    h = h.astype(jnp.float32)
    dead = jnp.diag(h) == 0
    h = jnp.where(jnp.diag(dead), 1.0, h)
    w = jnp.where(dead[None, :], 0.0, w)
    if act_order:
        perm = jnp.argsort(-jnp.diag(h), stable=True).astype(jnp.int32)
        w, h = w[:, perm], h[perm][:, perm]
    else:
        perm = jnp.arange(k, dtype=jnp.int32)
    u = _upper_cholesky_of_inverse(h, damp)
    ok = jnp.all(jnp.isfinite(u))

    b = block_size
    kp = -(-k // b) * b  # padded columns are zero weights with an identity inverse Hessian: no effect
    w = jnp.pad(w, ((0, 0), (0, kp - k)))
    u = jnp.pad(u, ((0, kp - k), (0, kp - k)))
    u = u + jnp.diag(jnp.concatenate([jnp.zeros(k), jnp.ones(kp - k)]))
    groups = -(-kp // g)
    zero_cols = jnp.zeros((n, groups), jnp.float32)

    def set_group(scales, zeros, column, params):
        index = column // g
        return scales.at[:, index].set(params[0]), zeros.at[:, index].set(params[1])

    def block_step(blk, carry):
        w, q_all, scales, zeros, scale, zero = carry
        i1 = blk * b
        w1 = lax.dynamic_slice(w, (0, i1), (n, b))
        u1 = lax.dynamic_slice(u, (i1, i1), (b, b))
        if g > b:  # groups start only at block starts; the group's columns are current in w
            scale, zero = lax.cond(
                i1 % g == 0,
                lambda: grid.params(lax.dynamic_slice(w, (0, i1), (n, g))),
                lambda: (scale, zero),
            )
            scales, zeros = set_group(scales, zeros, i1, (scale, zero))

        def column_step(i, inner):
            w1, q1, err1, scales, zeros, scale, zero = inner
            if g <= b:  # a group starts inside the block: its columns are current in w1
                scale, zero = lax.cond(
                    i % g == 0,
                    lambda: grid.params(lax.dynamic_slice(w1, (0, i), (n, g))),
                    lambda: (scale, zero),
                )
                scales, zeros = set_group(scales, zeros, i1 + i, (scale, zero))
            column = w1[:, i]
            q, dequantized = grid.quantize(column, scale, zero)
            err = (column - dequantized) / u1[i, i]
            w1 = w1 - err[:, None] * u1[i][None, :]  # u1 is upper triangular: only columns ≥ i move
            return w1, q1.at[:, i].set(q), err1.at[:, i].set(err), scales, zeros, scale, zero

        q1 = jnp.zeros((n, b), jnp.int8)
        err1 = jnp.zeros((n, b), jnp.float32)
        w1, q1, err1, scales, zeros, scale, zero = lax.fori_loop(
            0, b, column_step, (w1, q1, err1, scales, zeros, scale, zero)
        )
        q_all = lax.dynamic_update_slice(q_all, q1, (0, i1))
        # Lazy batch update of the later columns (rows i1..i1+b of u are zero left of i1).
        w = w - jnp.einsum("nb,bk->nk", err1, lax.dynamic_slice(u, (i1, 0), (b, kp)), precision=HIGHEST)
        return w, q_all, scales, zeros, scale, zero

    init = (w, jnp.zeros((n, kp), jnp.int8), zero_cols, zero_cols, jnp.zeros(n), jnp.zeros(n))
    _, q, scales, zeros, _, _ = lax.fori_loop(0, kp // b, block_step, init)
    return q[:, :k], scales[:, : k // g], zeros[:, : k // g], perm, ok


def gptq_quantize(
    w: jax.Array,
    hessian: jax.Array,
    grid: GroupGrid,
    *,
    act_order: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    damp: float = DEFAULT_DAMP,
) -> GPTQResult:
    """GPTQ of ``w (N, K)`` onto ``grid`` given the Hessian ``(K, K)`` (module docstring).

    ``block_size`` must be a multiple of the group size, or divide it (per-channel groups excepted);
    it is reduced to K for small layers. Raises ValueError when the dampened Hessian is not positive
    definite (raise ``damp``).
    """
    result, ok = gptq_traceable(
        jnp.asarray(w), jnp.asarray(hessian), grid, act_order=act_order, block_size=block_size, damp=damp
    )
    check_positive_definite(ok, damp)
    return result


def gptq_traceable(
    w: jax.Array,
    hessian: jax.Array,
    grid: GroupGrid,
    *,
    act_order: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    damp: float = DEFAULT_DAMP,
) -> tuple[GPTQResult, jax.Array]:
    """:func:`gptq_quantize` without the host check, usable inside ``jax.jit``: returns the result and
    ``ok`` (a bool array, False when the dampened Hessian is not positive definite; the result is
    then meaningless — pass ``ok`` to :func:`check_positive_definite` outside the jit)."""
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D (N, K), got shape {tuple(w.shape)}")
    k = w.shape[1]
    if hessian.shape != (k, k):
        raise ValueError(f"hessian must have shape ({k}, {k}), got {tuple(hessian.shape)}")
    if not 0 <= damp:
        raise ValueError(f"damp must be ≥ 0, got {damp}")
    g = grid.group_size
    if k % g:
        raise ValueError(f"K={k} must be a multiple of the group size {g}")
    if block_size < 1:
        raise ValueError(f"block_size must be ≥ 1, got {block_size}")
    block_size = min(block_size, k)
    if g != k and block_size % g and g % block_size:
        raise ValueError(
            f"block_size must be a multiple of group_size={g} or divide it, got {block_size}"
        )
    q, scales, zeros, perm, ok = _gptq(
        w, hessian, jnp.float32(damp), grid=grid, block_size=block_size, act_order=act_order
    )
    scales = scales.astype(grid.dtype)
    zeros = zeros.astype(jnp.uint8) if grid.zero_point else None
    if not act_order:
        return GPTQResult(q, scales, zeros, None), ok
    inverse = jnp.argsort(perm).astype(jnp.int32)
    return GPTQResult(q[:, inverse], scales, zeros, inverse // g), ok


def check_positive_definite(ok: jax.Array, damp: float) -> None:
    """Raises the ValueError of a failed Cholesky (``ok`` from :func:`gptq_traceable`)."""
    if not bool(ok):
        raise ValueError(
            f"gptq: the dampened Hessian is not positive definite (damp={damp}); raise damp or "
            "use more calibration tokens"
        )


def gptq(
    w: jax.Array,
    calib: jax.Array | Calibration,
    *,
    bias: jax.Array | None = None,
    group_size: int = 128,
    zero_point: bool = False,
    act_order: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    damp: float = DEFAULT_DAMP,
    dtype: jnp.dtype = jnp.bfloat16,
) -> W4A16Weights:
    """GPTQ weight-only int4 (w4a16) quantization of ``Y = X·Wᵀ + bias``.

    Args:
      w: ``(N, K)`` float weights. calib: calibration inputs ``(..., K)`` or a :class:`Calibration`
        (collected with the Hessian).
      bias: optional ``(N,)`` bias.
      group_size: 32, 64, 128, or -1 for per-channel.
      zero_point: asymmetric (AWQ-style) zero points instead of symmetric z = 8.
      act_order: process columns by decreasing ``diag(H)``; the result carries ``g_idx``.
      block_size: columns per lazy-update block. damp: relative dampening of ``diag(H)``.
      dtype: the layer's dtype (bf16 / fp16).

    Returns:
      :class:`jax_w4a4.W4A16Weights` with the prepacked kernel layout.
    """
    checks.one_of("gptq", "dtype", jnp.dtype(dtype), checks.HALF_DTYPES)
    dtype = jnp.dtype(dtype)
    w = jnp.asarray(w)
    if w.ndim != 2 or w.shape[1] % 2:
        raise ValueError(f"w must be 2-D (N, K) with K even, got shape {tuple(w.shape)}")
    n, k = w.shape
    groups = w4a16.n_groups(k, group_size)
    g = k // groups
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    calib = as_calibration(calib)
    if calib.in_features != k:
        raise ValueError(f"calib must have K={k} input features, got {calib.in_features}")
    result = gptq_quantize(
        w, calib.hessian(), GroupGrid("w4a16", g, dtype, zero_point),
        act_order=act_order, block_size=block_size, damp=damp,
    )
    qweight = pack_int4(result.q)
    return W4A16Weights.from_logical(
        qweight, result.scales, result.zeros,
        g_idx=result.g_idx,
        bias=None if bias is None else bias.astype(dtype),
        group_size=g,
    )


def gptq_svdq_residual(
    residual: jax.Array,
    hessian: jax.Array,
    *,
    dtype: jnp.dtype,
    block_size: int = DEFAULT_BLOCK_SIZE,
    damp: float = DEFAULT_DAMP,
) -> tuple[jax.Array, jax.Array]:
    """GPTQ of an SVDQuant residual onto the svdq int4 grid (absmax/7, group 64).

    ``hessian`` is the Hessian of the residual's inputs, the *smoothed* activations ``X̂ = X/λ``.
    Returns ``(qweight uint8 (N, K/2), wscales (N, K/64))`` as :func:`jax_w4a4.formats.svdq.quantize_weights`.
    """
    qweight, wscales, ok = gptq_svdq_residual_traceable(
        jnp.asarray(residual), jnp.asarray(hessian), dtype=dtype, block_size=block_size, damp=damp
    )
    check_positive_definite(ok, damp)
    return qweight, wscales


def gptq_svdq_residual_traceable(
    residual: jax.Array,
    hessian: jax.Array,
    *,
    dtype: jnp.dtype,
    block_size: int = DEFAULT_BLOCK_SIZE,
    damp: float = DEFAULT_DAMP,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`gptq_svdq_residual` inside ``jax.jit``: ``(qweight, wscales, ok)`` (see :func:`gptq_traceable`)."""
    checks.one_of("gptq_svdq_residual", "dtype", jnp.dtype(dtype), checks.HALF_DTYPES)
    grid = GroupGrid("svdq", svdq.GROUP_SIZE, jnp.dtype(dtype))
    result, ok = gptq_traceable(residual, hessian, grid, block_size=block_size, damp=damp)
    return pack_int4(result.q), result.scales, ok
