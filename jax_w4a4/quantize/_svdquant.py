"""SVDQuant (Li et al., 2024): smoothing, a low-rank branch in 16-bit, and a 4-bit residual.

Per input channel k the smoothing factor is ``λ_k = max|X_k|^a / max|W_k|^(1−a)`` (SmoothQuant's
migration strength a; ``max|X_k|`` over all calibration tokens, ``max|W_k|`` over the output rows;
both clamped below at 1e−5). Dividing the activations by λ moves their outliers into the weights, where
the rank-r SVD branch absorbs them: ``Ŵ = W·diag(λ) ≈ U_r S_r V_rᵀ + R``. The residual R is quantized
with RTN or GPTQ (on the smoothed activations' Hessian). The migration strength is chosen per layer
from a grid by the layer's relative output error on the calibration sample, measured through
:func:`jax_w4a4.linear` (the real quantized computation: CUDA kernels on GPU) against ``X·Wᵀ`` in fp32.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_w4a4.linear import linear
from jax_w4a4.ops import checks
from jax_w4a4.quantize._gptq import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DAMP,
    check_positive_definite,
    gptq_svdq_residual_traceable,
)
from jax_w4a4.quantize.calibration import Calibration, as_calibration
from jax_w4a4.quantize.report import layer_input, reference_output, squared_error
from jax_w4a4.weights import (
    SVDQuantWeights,
    assemble_svdquant_weights,
    build_svdquant_weights,
    check_svdq_in_features,
    low_rank_split,
)

DEFAULT_GRID: tuple[float, ...] = tuple(i / 10 for i in range(11))  # a = 0, 0.1, ..., 1 (one SVD each)
ACT_FORMATS = ("auto", "int4", "uint4", "fp8")
RESIDUALS = ("rtn", "gptq")
SMOOTH_EPS = 1e-5


def smoothing_factors(x_absmax: jax.Array, w_absmax: jax.Array, a: float | jax.Array) -> jax.Array:
    """``λ = max(x_absmax, ε)^a / max(w_absmax, ε)^(1−a)`` in fp32 (``(K,)`` each, ε = 1e−5)."""
    x_absmax = jnp.maximum(jnp.asarray(x_absmax, jnp.float32), SMOOTH_EPS)
    w_absmax = jnp.maximum(jnp.asarray(w_absmax, jnp.float32), SMOOTH_EPS)
    a = jnp.asarray(a, jnp.float32)
    return jnp.power(x_absmax, a) / jnp.power(w_absmax, 1.0 - a)


def weight_absmax(w: jax.Array) -> jax.Array:
    """``max |W[:, k]|`` over the output rows, fp32 ``(K,)``."""
    return jnp.max(jnp.abs(jnp.asarray(w, jnp.float32)), axis=0)


class SmoothingSearch(NamedTuple):
    """The grid search's outcome: chosen strength ``alpha``, its factors ``smooth (K,)``, and the
    relative output error of every grid point (``errors[i]`` for ``grid[i]``, RTN residual)."""

    alpha: float
    smooth: jax.Array
    grid: tuple[float, ...]
    errors: np.ndarray


def _grid_search(w, bias, x, x_absmax, grid, *, rank, act_format, dtype):
    """``(errors (len(grid),), smooth (K,))``: every grid point's relative output error (RTN residual)
    and the smoothing factors of the first best one. Traceable; one XLA program for the whole grid."""
    y_ref = reference_output(x, w, bias)
    w_absmax = weight_absmax(w)

    def error(a):
        smooth = smoothing_factors(x_absmax, w_absmax, a)
        weights = build_svdquant_weights(w, bias, smooth, rank=rank, act_format=act_format, dtype=dtype)
        return squared_error(linear(x, weights), y_ref)

    errors = jnp.sqrt(lax.map(error, grid) / jnp.sum(jnp.square(y_ref)))
    return errors, smoothing_factors(x_absmax, w_absmax, grid[jnp.argmin(errors)])


_STATIC = ("rank", "act_format", "dtype")
_grid_search_jit = jax.jit(_grid_search, static_argnames=_STATIC)


@functools.partial(jax.jit, static_argnames=(*_STATIC, "block_size", "damp"))
def _svdquant(w, bias, x, x_absmax, hessian, grid, *, rank, act_format, dtype, block_size, damp):
    """The whole SVDQuant of one layer as one XLA program, compiled once per distinct layer shape and
    options and reused by every layer that has them: the smoothing search (``grid``: None → λ = 1;
    one point → fixed strength; else the search), the split, the residual (GPTQ on the smoothed
    Hessian when ``hessian`` is given, else RTN) and the padded kernel layout.

    Returns ``(weights, errors (len(grid),) or (0,), ok)``; ``ok`` is False when GPTQ's Cholesky failed.
    """
    k = w.shape[1]
    errors = jnp.zeros((0,), jnp.float32)
    if grid is None:
        smooth = jnp.ones((k,), jnp.float32)
    elif grid.shape[0] == 1:
        smooth = smoothing_factors(x_absmax, weight_absmax(w), grid[0])
    else:
        errors, smooth = _grid_search(w, bias, x, x_absmax, grid, rank=rank, act_format=act_format, dtype=dtype)
    if hessian is None:
        weights = build_svdquant_weights(w, bias, smooth, rank=rank, act_format=act_format, dtype=dtype)
        return weights, errors, jnp.bool_(True)
    inv = 1.0 / smooth
    smoothed_hessian = hessian * inv[:, None] * inv[None, :]  # Hessian of X̂ = X / λ
    us, v, residual = low_rank_split(w, smooth, rank)
    qweight, wscales, ok = gptq_svdq_residual_traceable(
        residual, smoothed_hessian, dtype=dtype, block_size=block_size, damp=damp
    )
    weights = assemble_svdquant_weights(qweight, wscales, smooth, us, v, bias, act_format=act_format, dtype=dtype)
    return weights, errors, ok


def _check_errors(op: str, grid: tuple[float, ...], errors: np.ndarray) -> None:
    if not np.all(np.isfinite(errors)):
        checks.fail(op, f"non-finite output errors on the grid {grid}: {errors}")


def _check_layer(op: str, w, bias, calib: Calibration, rank: int, act_format: str, dtype) -> None:
    checks.one_of(op, "act_format", act_format, ACT_FORMATS)
    checks.one_of(op, "dtype", jnp.dtype(dtype), checks.HALF_DTYPES)
    checks.rank(op, "rank", rank)
    if w.ndim != 2:
        checks.fail(op, f"w must be 2-D (N, K) = (out_features, in_features), got shape {tuple(w.shape)}")
    n, k = w.shape
    check_svdq_in_features(op, k)
    if bias is not None:
        checks.shape_is(op, "bias", bias, (n,))
    if calib.in_features != k:
        checks.fail(op, f"calib must have K={k} input features, got {calib.in_features}")


def _check_grid(op: str, grid: Sequence[float]) -> tuple[float, ...]:
    grid = tuple(float(a) for a in grid)
    if not grid or any(not 0.0 <= a <= 1.0 for a in grid):
        checks.fail(op, f"grid must be a non-empty sequence of migration strengths in [0, 1], got {grid}")
    return grid


def resolve_act_format(act_format: str, calib: Calibration) -> str:
    """``"auto"`` → ``"uint4"`` when every calibration input is ≥ 0, else ``"int4"``; others unchanged."""
    if act_format != "auto":
        return act_format
    return "uint4" if calib.non_negative else "int4"


def search_smoothing(
    w: jax.Array,
    bias: jax.Array | None,
    calib: jax.Array | Calibration,
    *,
    rank: int = 32,
    grid: Sequence[float] = DEFAULT_GRID,
    act_format: str = "int4",
    dtype: jnp.dtype = jnp.bfloat16,
) -> SmoothingSearch:
    """Chooses the migration strength a on ``grid`` minimizing the layer's relative output error.

    Each candidate is the full SVDQuant layer (smoothing, rank-r branch, RTN residual) run through
    :func:`jax_w4a4.linear` on the calibration sample; ties go to the first grid point.
    """
    op = "search_smoothing"
    w = jnp.asarray(w, jnp.float32)
    calib = as_calibration(calib, with_hessian=False)
    _check_layer(op, w, bias, calib, rank, act_format, dtype)
    grid = _check_grid(op, grid)
    act_format = resolve_act_format(act_format, calib)
    errors, smooth = _grid_search_jit(
        w, bias, layer_input(calib.sample, dtype), calib.absmax, jnp.asarray(grid, jnp.float32),
        rank=rank, act_format=act_format, dtype=jnp.dtype(dtype),
    )
    errors = np.asarray(errors)
    _check_errors(op, grid, errors)
    return SmoothingSearch(grid[int(np.argmin(errors))], smooth, grid, errors)


def svdquant(
    w: jax.Array,
    bias: jax.Array | None,
    calib: jax.Array | Calibration,
    *,
    rank: int = 32,
    grid: Sequence[float] | None = DEFAULT_GRID,
    residual: str = "gptq",
    act_format: str = "int4",
    dtype: jnp.dtype = jnp.bfloat16,
    block_size: int = DEFAULT_BLOCK_SIZE,
    damp: float = DEFAULT_DAMP,
) -> SVDQuantWeights:
    """SVDQuant decomposition of ``Y = X·Wᵀ + bias`` from calibration inputs (module docstring).

    Args:
      w: ``(N, K)`` float weights (out_features, in_features). bias: optional ``(N,)``.
      calib: calibration inputs ``(..., K)`` or a :class:`Calibration`.
      rank: low-rank rank r (multiple of 16, ≤ 256; 0: no branch).
      grid: migration strengths a to search (:func:`search_smoothing`, with an RTN residual); one
        point fixes a; None disables smoothing (λ = 1).
      residual: ``"rtn"`` or ``"gptq"`` (on the Hessian of the smoothed inputs ``X/λ``).
      act_format: ``"int4"``, ``"uint4"`` (inputs ≥ 0), ``"fp8"`` (the w4a8 mode) or ``"auto"``
        (uint4 when every calibration input is ≥ 0, else int4).
      dtype: the layer's dtype (bf16 / fp16). block_size, damp: GPTQ settings.

    Returns:
      :class:`jax_w4a4.SVDQuantWeights` (same layout and math as ``quantize_linear``'s).
    """
    op = "svdquant"
    w = jnp.asarray(w, jnp.float32)
    checks.one_of(op, "residual", residual, RESIDUALS)
    calib = as_calibration(calib, with_hessian=residual == "gptq")
    _check_layer(op, w, bias, calib, rank, act_format, dtype)
    dtype = jnp.dtype(dtype)
    act_format = resolve_act_format(act_format, calib)
    grid = None if grid is None else _check_grid(op, grid)
    search = grid is not None and len(grid) > 1
    weights, errors, ok = _svdquant(
        w, bias,
        layer_input(calib.sample, dtype) if search else None,
        None if grid is None else calib.absmax,
        calib.hessian() if residual == "gptq" else None,
        None if grid is None else jnp.asarray(grid, jnp.float32),
        rank=rank, act_format=act_format, dtype=dtype, block_size=block_size, damp=damp,
    )
    if search:
        _check_errors(op, grid, np.asarray(errors))
    if residual == "gptq":
        check_positive_definite(ok, damp)
    return weights
