"""Import AutoGPTQ / AutoAWQ int4 checkpoints into :class:`jax_w4a4.W4A16Weights`.

Both formats store ``Ŵ[n, k] = (q[n, k] − z[n, g(k)]) · s[n, g(k)]`` with uint4 ``q`` and ``z``
packed eight nibbles per int32 word, nibble ``i`` in bits ``4i .. 4i+3``. The layouts below are the
AutoGPTQ / AutoAWQ packing as documented in their repositories; ``N`` = out_features,
``K`` = in_features, ``G = K / group_size`` groups.

**AutoGPTQ** (``from_gptq``):

* ``qweight`` int32 ``(K/8, N)``, packed along K: nibble ``i`` of word ``[r, n]`` is ``q[n, 8r + i]``.
* ``qzeros`` int32 ``(G, N/8)``, packed along N: nibble ``i`` of word ``[g, c]`` is the zero point of
  column ``8c + i`` in group ``g``. ``checkpoint_format="gptq"`` (v1) stores ``z − 1`` (so a
  symmetric checkpoint stores 7 for z = 8); ``"gptq_v2"`` stores ``z`` itself.
* ``scales`` float ``(G, N)``; ``g_idx`` int32 ``(K,)``, the group of every input row (act-order when
  it is not ``arange(K) // group_size``).

**AutoAWQ GEMM** (``from_awq``):

* ``qweight`` int32 ``(K, N/8)``, packed along N in the interleaved order
  ``AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``: nibble slot ``j`` of word ``[k, c]`` is
  ``q[8c + AWQ_ORDER[j], k]``.
* ``qzeros`` int32 ``(G, N/8)`` with the same interleave; ``scales`` float ``(G, N)``; no ``g_idx``.

The import is exact: ``q`` and ``z`` are carried bit for bit, scales and bias are cast to ``dtype``.
A v1 zero nibble of 15 would mean ``z = 16``, which uint4 zero points cannot hold (it is what v1
writes for a real zero point of 0); it is rejected. Inputs are concrete arrays (numpy, JAX, or
anything ``numpy.asarray`` accepts); the unpacking runs eagerly in numpy.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from jax_w4a4.formats import w4a16, w4a16_layout
from jax_w4a4.formats.int4 import pack_int4
from jax_w4a4.ops import checks
from jax_w4a4.weights import W4A16Weights

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GPTQ_FORMATS = ("gptq", "gptq_v2")
_NIBBLES = 8


def _int32_2d(op: str, name: str, value: ArrayLike, expected: str) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != 2 or array.dtype != np.int32:
        checks.fail(op, f"{name} must be int32 {expected}, got {array.dtype}{tuple(array.shape)}")
    return array


def _unpack_words(words: np.ndarray) -> np.ndarray:
    """int32 ``(..., W)`` -> uint8 ``(..., W, 8)``: ``[..., w, i]`` is nibble i (bits 4i..4i+3)."""
    shifts = np.arange(_NIBBLES, dtype=np.uint32) * 4
    return ((words.view(np.uint32)[..., None] >> shifts) & 0xF).astype(np.uint8)


def _groups(op: str, k: int, group_size: int) -> tuple[int, int]:
    """(number of groups, real group size) for the checkpoint's ``group_size`` (-1: per channel)."""
    try:
        groups = w4a16.n_groups(k, group_size)
    except ValueError as err:
        raise ValueError(f"jax_w4a4.{op}: group_size (K={k}): {err}") from err
    return groups, k // groups


def _assemble(
    op: str,
    q_kn: np.ndarray,
    zeros_gn: np.ndarray | None,
    scales: ArrayLike,
    *,
    g_idx: np.ndarray | None,
    bias: ArrayLike | None,
    group_size: int,
    dtype: DTypeLike,
) -> W4A16Weights:
    """Logical ``q (K, N)``, ``z (G, N)`` or None, ``scales (G, N)`` -> prepacked W4A16Weights."""
    k, n = q_kn.shape
    groups = k // group_size
    scales = jnp.asarray(scales)
    checks.shape_is(op, "scales", scales, (groups, n))
    if not jnp.issubdtype(scales.dtype, jnp.floating):
        checks.fail(op, f"scales must be a float array (G, N) = {(groups, n)}, got {scales.dtype}")
    if bias is not None:
        bias = jnp.asarray(bias)
        checks.shape_is(op, "bias", bias, (n,))
        bias = bias.astype(dtype)
    g_idx_j = None if g_idx is None else jnp.asarray(g_idx, jnp.int32)
    qweight = pack_int4(jnp.asarray(q_kn.T))
    return W4A16Weights(
        qweight=w4a16_layout.prepack(qweight, g_idx=g_idx_j, group_size=group_size),
        scales=scales.astype(dtype),  # (G, N): the checkpoints' layout is the kernel's (prepack_scales)
        zeros=None if zeros_gn is None else jnp.asarray(zeros_gn),
        g_idx=g_idx_j,
        bias=bias,
        group_size=group_size,
    )


def from_gptq(
    qweight: ArrayLike,
    qzeros: ArrayLike,
    scales: ArrayLike,
    *,
    g_idx: ArrayLike | None = None,
    bias: ArrayLike | None = None,
    group_size: int,
    sym: bool = True,
    checkpoint_format: str = "gptq",
    dtype: DTypeLike = jnp.float16,
) -> W4A16Weights:
    """An AutoGPTQ 4-bit linear layer (module docstring has the layouts) as :class:`W4A16Weights`.

    Args:
      qweight: int32 ``(K/8, N)``. qzeros: int32 ``(G, N/8)``. scales: float ``(G, N)``.
      g_idx: optional int ``(K,)`` group of every input row. The trivial ``arange(K) // group_size``
        is dropped; an act-order one is kept (each group must hold exactly ``group_size`` rows, the
        structure GPTQ act-order produces and the kernel layout needs).
      bias: optional ``(N,)``.
      group_size: the checkpoint's group size: 32, 64, 128, or -1 (or K) for per channel.
      sym: the checkpoint's ``sym`` flag. When true and every zero point is 8 the weights use the
        symmetric form (``zeros=None``); otherwise the zero points are kept.
      checkpoint_format: ``"gptq"`` (v1, stores ``z − 1``) or ``"gptq_v2"`` (stores ``z``).
      dtype: the layer's dtype, float16 or bfloat16 (scales and bias are cast to it).

    Returns:
      :class:`jax_w4a4.W4A16Weights` with the kernel's prepacked ``qweight``.
    """
    op = "from_gptq"
    checks.one_of(op, "checkpoint_format", checkpoint_format, GPTQ_FORMATS)
    checks.one_of(op, "dtype", jnp.dtype(dtype), checks.HALF_DTYPES)
    qweight = _int32_2d(op, "qweight", qweight, "(K/8, N)")
    k, n = _NIBBLES * qweight.shape[0], qweight.shape[1]
    checks.multiple_of(op, "N (qweight.shape[1])", n, _NIBBLES, " (qzeros packs 8 columns per word)")
    groups, real_group = _groups(op, k, group_size)
    qzeros = _int32_2d(op, "qzeros", qzeros, f"(G, N/8) = {(groups, n // _NIBBLES)}")
    checks.shape_is(op, "qzeros", qzeros, (groups, n // _NIBBLES))

    # (K/8, N, 8) -> (K/8, 8, N) -> (K, N): row 8r + i is nibble i of row r.
    q_kn = _unpack_words(qweight).transpose(0, 2, 1).reshape(k, n)
    zeros = _unpack_words(qzeros).reshape(groups, n)
    if checkpoint_format == "gptq":
        if (zeros == 15).any():
            checks.fail(
                op,
                "qzeros: a gptq (v1) zero nibble of 15 means z = 16, outside the uint4 range 0..15 "
                "(v1 cannot store z = 0); convert the checkpoint to gptq_v2",
            )
        zeros = zeros + 1
    if sym and (zeros == w4a16.SYMMETRIC_ZERO).all():
        zeros = None

    if g_idx is not None:
        g_idx = np.asarray(g_idx)
        if g_idx.shape != (k,) or not np.issubdtype(g_idx.dtype, np.integer):
            checks.fail(op, f"g_idx must be an integer array of shape ({k},), got {g_idx.dtype}{g_idx.shape}")
        if (g_idx == np.arange(k) // real_group).all():
            g_idx = None
    return _assemble(
        op, q_kn, zeros, scales, g_idx=g_idx, bias=bias, group_size=real_group, dtype=dtype
    )


def from_awq(
    qweight: ArrayLike,
    qzeros: ArrayLike,
    scales: ArrayLike,
    *,
    bias: ArrayLike | None = None,
    group_size: int,
    dtype: DTypeLike = jnp.float16,
) -> W4A16Weights:
    """An AutoAWQ GEMM-format 4-bit linear layer (module docstring) as :class:`W4A16Weights`.

    Args:
      qweight: int32 ``(K, N/8)``. qzeros: int32 ``(G, N/8)``. scales: float ``(G, N)``.
      bias: optional ``(N,)``.
      group_size: the checkpoint's ``q_group_size``: 32, 64, 128, or -1 (or K) for per channel.
      dtype: the layer's dtype, float16 or bfloat16 (scales and bias are cast to it).

    Returns:
      :class:`jax_w4a4.W4A16Weights` with zero points and the kernel's prepacked ``qweight``.
    """
    op = "from_awq"
    checks.one_of(op, "dtype", jnp.dtype(dtype), checks.HALF_DTYPES)
    qweight = _int32_2d(op, "qweight", qweight, "(K, N/8)")
    k, n = qweight.shape[0], _NIBBLES * qweight.shape[1]
    if k % 2:
        checks.fail(op, f"K (qweight.shape[0]) must be even, got {k}")
    groups, real_group = _groups(op, k, group_size)
    qzeros = _int32_2d(op, "qzeros", qzeros, f"(G, N/8) = {(groups, n // _NIBBLES)}")
    checks.shape_is(op, "qzeros", qzeros, (groups, n // _NIBBLES))

    # Slot j of word c holds column 8c + AWQ_ORDER[j]; column 8c + m is slot argsort(AWQ_ORDER)[m].
    slot_of_column = np.argsort(AWQ_ORDER)
    q_kn = _unpack_words(qweight)[..., slot_of_column].reshape(k, n)
    zeros = _unpack_words(qzeros)[..., slot_of_column].reshape(groups, n)
    return _assemble(
        op, q_kn, zeros, scales, g_idx=None, bias=bias, group_size=real_group, dtype=dtype
    )
