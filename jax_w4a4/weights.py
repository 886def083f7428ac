"""Quantized weights as registered pytrees, and round-to-nearest quantization of a linear layer.

``W`` is ``(N, K)`` = (out_features, in_features), the torch / Nunchaku orientation (a Flax
``nnx.Linear`` kernel is its transpose). Calibration-based SVDQuant and GPTQ live in
``jax_w4a4.quantize`` (offline quantization); here every mode is plain RTN, with the SVD low-rank
branch (data-free) for the W4A4 modes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Literal

import jax
import jax.numpy as jnp

from jax_w4a4.formats import fp4, fp8, svdq, svdq_layout, w4a16, w4a16_layout
from jax_w4a4.ops import checks

Mode = Literal["svdq-int4", "w4a8", "w4a16"]
MODES: tuple[str, ...] = ("svdq-int4", "w4a8", "w4a16")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SVDQuantWeights:
    """W4A4 (or W4A8) weights with a low-rank branch: ``Y = α ⊙ Q(X̂)·Q(R)ᵀ + (X·L_down)·L_up + β``.

    Attributes:
      qweight: packed signed int4 residual weights in the GEMM's prepacked layout
        (:mod:`jax_w4a4.formats.svdq_layout`; ``unprepack`` recovers the logical ``(N, K/2)`` uint8).
      wscales: bf16/fp16 group scales in the GEMM's stage-major layout ``(K/128, N, 2)``
        (:func:`jax_w4a4.formats.svdq_layout.prepack_scales` of the logical ``(N, K/64)``;
        ``unprepack_scales`` recovers it); their dtype is the layer's dtype.
      smooth: ``(K,)`` fp32 smoothing factors λ (activations are divided by λ before quantization).
      lora_down: ``(K, r)`` low-rank down projection, layer dtype (r = 0: no branch).
      lora_up: ``(r, N)`` low-rank up projection, layer dtype.
      alpha: ``(N,)`` fp32 per-column scale of the quantized product, or None.
      bias: ``(N,)`` bias in the layer dtype, or None.
      act_format: ``"int4"``, ``"uint4"`` (non-negative inputs) or ``"fp8"`` (the w4a8 mode). Static.
      in_padding, out_padding: zero columns / rows appended to the logical ``(N, K)`` weight so that
        the arrays have the CUDA kernel's shape (:func:`kernel_padding`). Static.

    **Padding.** The W4A4 / W4A8 kernel needs N and K to be multiples of 128 (its tile; also the fp8
    activation group), so the arrays hold the weight zero-padded to ``(N + out_padding, K +
    in_padding)``: zero rows of the residual, its scales, ``lora_up`` and the bias; zero rows of
    ``lora_down``; ``smooth = 1`` on the padded columns. :func:`jax_w4a4.linear` appends zero
    columns to ``x`` (:meth:`pad_input`) and drops the padded outputs (:meth:`crop_output`), on every
    platform, so the reference path runs exactly the GPU's computation. Padded columns are zero in
    both ``X`` and ``W``: they add nothing to any product, and an all-zero activation group has scale
    0. So the result is the logical layer's, except that an fp8 group of 128 that straddles K (K =
    576: the group ``[512, 640)``) takes its scale from its real columns only, as a group of 64.
    ``in_features`` / ``out_features`` are the logical sizes.
    """

    qweight: jax.Array
    wscales: jax.Array
    smooth: jax.Array
    lora_down: jax.Array
    lora_up: jax.Array
    alpha: jax.Array | None = None
    bias: jax.Array | None = None
    act_format: str = dataclasses.field(default="int4", metadata=dict(static=True))
    in_padding: int = dataclasses.field(default=0, metadata=dict(static=True))
    out_padding: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def padded_in_features(self) -> int:
        """K of the stored arrays (the kernel's K): ``in_features + in_padding``."""
        return svdq_layout.prepacked_scales_sizes(self.wscales.shape)[1]

    @property
    def padded_out_features(self) -> int:
        """N of the stored arrays (the kernel's N): ``out_features + out_padding``."""
        return svdq_layout.prepacked_scales_sizes(self.wscales.shape)[0]

    @property
    def in_features(self) -> int:
        return self.padded_in_features - self.in_padding

    @property
    def out_features(self) -> int:
        return self.padded_out_features - self.out_padding

    def pad_input(self, x: jax.Array) -> jax.Array:
        """``x (..., in_features)`` with ``in_padding`` zero columns appended (x itself when none)."""
        if not self.in_padding:
            return x
        return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, self.in_padding)])

    def crop_output(self, y: jax.Array) -> jax.Array:
        """``y (..., padded_out_features)`` without the padded outputs (y itself when none)."""
        return y[..., : self.out_features] if self.out_padding else y

    @property
    def rank(self) -> int:
        return self.lora_down.shape[1]

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.wscales.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class W4A16Weights:
    """Weight-only int4 (GPTQ / AWQ / MARLIN semantics): ``Y = X · Ŵᵀ + β``, ``Ŵ = (q − z)·s``.

    Attributes:
      qweight: uint4 weights in the kernel's prepacked layout (:mod:`jax_w4a4.formats.w4a16_layout`;
        ``unprepack`` recovers the logical ``(N, K/2)`` layout bit for bit).
      scales: group scales in the kernel layout ``(K/G, N)`` (``w4a16_layout.prepack_scales`` of the
        logical ``(N, K/G)``; ``unprepack_scales`` recovers it); their dtype (bf16/fp16) is the layer's dtype.
      zeros: uint8 zero points 0..15 (AWQ) in the same ``(K/G, N)`` layout, or None for symmetric (z = 8).
      g_idx: ``(K,)`` int32 group of every input feature (act-order), or None.
      bias: ``(N,)`` bias in the layer dtype, or None.
      group_size: the group size G along K (K itself for per-channel). Static.
    """

    qweight: jax.Array
    scales: jax.Array
    zeros: jax.Array | None = None
    g_idx: jax.Array | None = None
    bias: jax.Array | None = None
    group_size: int = dataclasses.field(default=128, metadata=dict(static=True))

    @classmethod
    def from_logical(
        cls,
        qweight: jax.Array,
        scales: jax.Array,
        zeros: jax.Array | None = None,
        *,
        g_idx: jax.Array | None = None,
        bias: jax.Array | None = None,
        group_size: int,
    ) -> W4A16Weights:
        """Weights from the logical layouts of :mod:`jax_w4a4.formats.w4a16` (uint8 ``(N, K/2)`` codes,
        ``(N, K/G)`` scales and zero points), prepacked into the kernel's; ``group_size`` is G (K per channel)."""
        return cls(
            qweight=w4a16_layout.prepack(qweight, g_idx=g_idx, group_size=group_size),
            scales=w4a16_layout.prepack_scales(scales),
            zeros=None if zeros is None else w4a16_layout.prepack_scales(zeros),
            g_idx=g_idx,
            bias=bias,
            group_size=group_size,
        )

    def dequantize(self) -> jax.Array:
        """The weight ``Ŵ = (q − z)·s`` in fp32 ``(N, K)``, read back from the kernel layouts (exact)."""
        logical = w4a16_layout.unprepack(self.qweight, self.out_features, self.in_features)
        zeros = None if self.zeros is None else w4a16_layout.unprepack_scales(self.zeros)
        return w4a16.dequantize(
            logical, w4a16_layout.unprepack_scales(self.scales), zeros, group_size=self.group_size, g_idx=self.g_idx
        )

    @property
    def in_features(self) -> int:
        return self.group_size * self.scales.shape[0]

    @property
    def out_features(self) -> int:
        return self.scales.shape[1]

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.scales.dtype)


FP4_FORMATS: tuple[str, ...] = ("nvfp4", "mxfp4")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FakeQuantFP4Weights:
    """nvfp4 / mxfp4 weights evaluated through the reference math (weight-only, fake-quantized).

    ``Y = X · Ŵᵀ + β`` with ``Ŵ = dequantize_nvfp4 / dequantize_mxfp4`` (:mod:`jax_w4a4.formats.fp4`),
    an fp32 dot with fp32 accumulation, output in X's dtype; activations are not quantized. There is
    no CUDA kernel for these formats on Hopper yet: :func:`jax_w4a4.linear` runs them as plain XLA
    ops (dequantize, then dot) on every platform. They exist so accuracy tables can include FP4.

    Attributes:
      packed: ``(N, K/2)`` uint8 e2m1 codes, two per byte.
      scales: ``(N, K/16)`` uint8 e4m3 bits (nvfp4) or ``(N, K/32)`` uint8 e8m0 exponents (mxfp4).
      tensor_scale: fp32 ``()`` tensor scale (nvfp4), or None (mxfp4).
      bias: ``(N,)`` bias in the layer dtype, or None.
      fmt: ``"nvfp4"`` or ``"mxfp4"``. Static.
      dtype_name: the layer's dtype (``"bfloat16"`` or ``"float16"``); inputs must have it. Static.
    """

    packed: jax.Array
    scales: jax.Array
    tensor_scale: jax.Array | None = None
    bias: jax.Array | None = None
    fmt: str = dataclasses.field(default="nvfp4", metadata=dict(static=True))
    dtype_name: str = dataclasses.field(default="bfloat16", metadata=dict(static=True))

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 2

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype_name)

    def dequantize(self) -> jax.Array:
        """The fake-quantized weight ``Ŵ`` in fp32 ``(N, K)``."""
        if self.fmt == "nvfp4":
            return fp4.dequantize_nvfp4(self.packed, self.scales, self.tensor_scale)
        return fp4.dequantize_mxfp4(self.packed, self.scales)


QuantizedWeights = SVDQuantWeights | W4A16Weights | FakeQuantFP4Weights


def _register_for_export(cls: type) -> None:
    """Lets ``jax.export`` serialize functions that take the weights as arguments (static fields as JSON)."""
    jax.export.register_pytree_node_serialization(
        cls,
        serialized_name=f"jax_w4a4.{cls.__name__}",
        serialize_auxdata=lambda static: json.dumps(list(static)).encode(),
        deserialize_auxdata=lambda data: tuple(json.loads(data)),
    )


_register_for_export(SVDQuantWeights)
_register_for_export(W4A16Weights)
_register_for_export(FakeQuantFP4Weights)


def kernel_padding(out_features: int, in_features: int) -> tuple[int, int]:
    """``(out_padding, in_padding)``: the zero rows / columns that bring an ``(N, K)`` svdq weight to
    the W4A4 / W4A8 kernel's multiples (N and K multiples of 128, its tile; 128 is also the fp8
    activation group). Applied on every platform (:class:`SVDQuantWeights`, "Padding")."""
    n_multiple = svdq_layout.KERNEL_N_MULTIPLE
    k_multiple = math.lcm(svdq_layout.KERNEL_K_MULTIPLE, fp8.GROUP_SIZE, svdq.GROUP_SIZE)
    return -out_features % n_multiple, -in_features % k_multiple


def low_rank_split(w: jax.Array, smooth: jax.Array, rank: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The SVDQuant split of the smoothed weight ``Ŵ = W·diag(λ)`` (fp32, logical shapes).

    Returns ``(U_r S_r (N, r), V_r (K, r), R = Ŵ − U_r S_r V_rᵀ (N, K))`` from the top-r SVD of Ŵ
    (rank 0: empty factors and ``R = Ŵ``).
    """
    w_hat = w.astype(jnp.float32) * smooth.astype(jnp.float32)
    if rank == 0:
        n, k = w_hat.shape
        return jnp.zeros((n, 0), w_hat.dtype), jnp.zeros((k, 0), w_hat.dtype), w_hat
    u, s, vt = jnp.linalg.svd(w_hat, full_matrices=False)
    us = u[:, :rank] * s[:rank]
    v = vt[:rank].T
    return us, v, w_hat - us @ v.T


def quantize_linear(
    w: jax.Array,
    bias: jax.Array | None = None,
    *,
    mode: Mode = "svdq-int4",
    rank: int = 32,
    smooth: jax.Array | None = None,
    unsigned_activations: bool = False,
    group_size: int = 128,
    zero_point: bool = False,
    g_idx: jax.Array | None = None,
    dtype: jnp.dtype = jnp.bfloat16,
) -> QuantizedWeights:
    """Quantizes a linear layer ``Y = X·Wᵀ + bias`` with round-to-nearest.

    Args:
      w: ``(N, K)`` float weights (out_features, in_features).
      bias: optional ``(N,)`` bias.
      mode: ``"svdq-int4"`` (W4A4 + low-rank), ``"w4a8"`` (same weights, fp8 activations) or
        ``"w4a16"`` (weight-only int4).
      rank: low-rank branch rank r for the W4A4 modes (multiple of 16, ≤ 256; 0 disables it).
      smooth: optional ``(K,)`` positive smoothing factors λ for the W4A4 modes (default: ones).
      unsigned_activations: svdq-int4 only: quantize activations as uint4 (inputs must be ≥ 0).
      group_size: w4a16 group size: 32, 64, 128, or -1 for per-channel.
      zero_point: w4a16 only: asymmetric (AWQ) zero points instead of symmetric (GPTQ, z = 8).
      g_idx: w4a16 only: optional ``(K,)`` int32 act-order group index.
      dtype: the layer's compute dtype, bf16 or fp16; inputs to :func:`linear` must have it.

    Returns:
      :class:`SVDQuantWeights` or :class:`W4A16Weights`.
    """
    op = "quantize_linear"
    checks.one_of(op, "mode", mode, MODES)
    checks.one_of(op, "dtype", jnp.dtype(dtype), checks.HALF_DTYPES)
    if w.ndim != 2:
        checks.fail(op, f"w must be 2-D (N, K) = (out_features, in_features), got shape {tuple(w.shape)}")
    n, k = w.shape
    if bias is not None:
        checks.shape_is(op, "bias", bias, (n,))
        bias = bias.astype(dtype)
    w = w.astype(jnp.float32)
    if mode == "w4a16":
        q = w4a16.quantize(w, group_size=group_size, zero_point=zero_point, scale_dtype=dtype, g_idx=g_idx)
        return W4A16Weights.from_logical(
            q.qweight, q.scales, q.zeros,
            g_idx=None if g_idx is None else g_idx.astype(jnp.int32),
            bias=bias,
            group_size=k if group_size == -1 else group_size,
        )
    checks.rank(op, "rank", rank)
    check_svdq_in_features(op, k)
    smooth = jnp.ones((k,), jnp.float32) if smooth is None else smooth.astype(jnp.float32)
    checks.shape_is(op, "smooth", smooth, (k,))
    act_format = "fp8" if mode == "w4a8" else ("uint4" if unsigned_activations else "int4")
    return build_svdquant_weights(w, bias, smooth, rank=rank, act_format=act_format, dtype=dtype)


def check_svdq_in_features(op: str, k: int) -> None:
    """ValueError unless K is a multiple of the svdq weight group (64); the kernel's multiple of 128
    and the fp8 group are reached by padding (:func:`kernel_padding`)."""
    checks.multiple_of(
        op, "K (w.shape[1])", k, svdq.GROUP_SIZE,
        " (the svdq weight group; the layer is then zero-padded to the kernel's multiple of "
        f"{svdq_layout.KERNEL_K_MULTIPLE})",
    )


def build_svdquant_weights(
    w: jax.Array,
    bias: jax.Array | None,
    smooth: jax.Array,
    *,
    rank: int,
    act_format: str,
    dtype: jnp.dtype,
) -> SVDQuantWeights:
    """The SVDQuant decomposition for given smoothing factors, RTN residual (jit-able; shapes are not
    re-checked): :func:`low_rank_split`, :func:`jax_w4a4.formats.svdq.quantize_weights`, then
    :func:`assemble_svdquant_weights`.

    Args:
      w: ``(N, K)`` fp32 weights. bias: ``(N,)`` or None (cast to ``dtype``).
      smooth: ``(K,)`` positive fp32 smoothing factors λ.
      rank: low-rank rank r (multiple of 16, ≤ 256, or 0). act_format: ``"int4"``, ``"uint4"``, ``"fp8"``.
      dtype: the layer's dtype (bf16 / fp16).
    """
    smooth = smooth.astype(jnp.float32)
    us, v, residual = low_rank_split(w, smooth, rank)
    qweight, wscales = svdq.quantize_weights(residual, scale_dtype=dtype)
    return assemble_svdquant_weights(qweight, wscales, smooth, us, v, bias, act_format=act_format, dtype=dtype)


def assemble_svdquant_weights(
    qweight: jax.Array,
    wscales: jax.Array,
    smooth: jax.Array,
    us: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    *,
    act_format: str,
    dtype: jnp.dtype,
) -> SVDQuantWeights:
    """:class:`SVDQuantWeights` from a quantized residual and the low-rank factors (logical shapes):
    ``L_down = diag(1/λ)·V_r``, ``L_up = (U_r S_r)ᵀ``, every array zero-padded to the kernel's
    multiples (:func:`kernel_padding`; ``smooth`` padded with ones), the residual and its scales prepacked.

    Args:
      qweight: logical uint8 ``(N, K/2)`` residual. wscales: ``(N, K/64)`` in ``dtype``.
      smooth: ``(K,)`` fp32 λ. us: ``(N, r)`` ``U_r S_r``. v: ``(K, r)`` ``V_r``. bias: ``(N,)`` or None.
      act_format: ``"int4"``, ``"uint4"``, ``"fp8"``. dtype: the layer's dtype (bf16 / fp16).
    """
    n, k = wscales.shape[0], wscales.shape[1] * svdq.GROUP_SIZE
    out_padding, in_padding = kernel_padding(n, k)
    rows, cols = (0, out_padding), (0, in_padding)
    return SVDQuantWeights(
        qweight=svdq_layout.prepack(jnp.pad(qweight, (rows, (0, in_padding // 2)))),
        wscales=svdq_layout.prepack_scales(jnp.pad(wscales, (rows, (0, in_padding // svdq.GROUP_SIZE)))),
        smooth=jnp.pad(smooth, cols, constant_values=1.0),
        lora_down=jnp.pad((v / smooth[:, None]).astype(dtype), (cols, (0, 0))),
        lora_up=jnp.pad(us.T.astype(dtype), ((0, 0), rows)),
        bias=None if bias is None else jnp.pad(bias.astype(dtype), rows),
        act_format=act_format,
        in_padding=in_padding,
        out_padding=out_padding,
    )


def quantize_fp4(
    w: jax.Array, bias: jax.Array | None = None, *, fmt: str = "nvfp4", dtype: jnp.dtype = jnp.bfloat16
) -> FakeQuantFP4Weights:
    """Round-to-nearest nvfp4 / mxfp4 weights (:mod:`jax_w4a4.formats.fp4`), evaluated as XLA ops.

    Args:
      w: ``(N, K)`` float weights; K a multiple of 16 (nvfp4) or 32 (mxfp4). bias: optional ``(N,)``.
      fmt: ``"nvfp4"`` (e4m3 scale per 16 × one fp32 tensor scale) or ``"mxfp4"`` (e8m0 per 32).
      dtype: the layer's dtype, bf16 or fp16; inputs to :func:`linear` must have it.
    """
    op = "quantize_fp4"
    checks.one_of(op, "fmt", fmt, FP4_FORMATS)
    checks.one_of(op, "dtype", jnp.dtype(dtype), checks.HALF_DTYPES)
    if w.ndim != 2:
        checks.fail(op, f"w must be 2-D (N, K) = (out_features, in_features), got shape {tuple(w.shape)}")
    block = fp4.NVFP4_BLOCK if fmt == "nvfp4" else fp4.MXFP4_BLOCK
    checks.multiple_of(op, "K (w.shape[1])", w.shape[1], block, f" for fmt={fmt!r}")
    if bias is not None:
        checks.shape_is(op, "bias", bias, (w.shape[0],))
        bias = bias.astype(dtype)
    w = w.astype(jnp.float32)
    if fmt == "nvfp4":
        packed, scales, tensor_scale = fp4.quantize_nvfp4(w)
    else:
        (packed, scales), tensor_scale = fp4.quantize_mxfp4(w), None
    return FakeQuantFP4Weights(
        packed=packed, scales=scales, tensor_scale=tensor_scale, bias=bias, fmt=fmt,
        dtype_name=jnp.dtype(dtype).name,
    )
