"""The fused ops as JAX primitives: abstract eval, lowerings (CUDA FFI, reference), batching.

Every op is one :class:`FusedOp`: its abstract evaluation validates the operands (ValueError naming the
argument and the expected value) and computes the result shapes; it lowers through
``jax.ffi.ffi_lowering`` to ``jax_w4a4_<op>`` on CUDA and through :mod:`jax_w4a4.reference` everywhere
else (under ``jax.jit`` over several devices, through the Shardy rule and partition callback of
:mod:`jax_w4a4.ops.partitioning` first, whose per-device computation lowers as on one device); its
batching rule maps vmap onto the leading dims of the activations (or onto a loop over the batch when
the weights themselves are batched). Operand order and layouts: ``docs/layouts.md``.

``w4a4_linear`` is ``act_quant`` then ``w4a4_gemm`` as one primitive, what :func:`jax_w4a4.linear` runs:
one FFI call launches both kernels, so that the GEMM starts while act_quant runs (programmatic dependent launch).
Over several devices it partitions as one op: each device runs the one call on its columns, tokens and K slice
(row parallel: without β, then one psum of the partial outputs and β once).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_w4a4 import budget, reference
from jax_w4a4.formats import svdq_layout, w4a16, w4a16_layout
from jax_w4a4.ops import _library, checks, partitioning

ShapedArray = jax.core.ShapedArray
EMPTY = (0,)


@dataclasses.dataclass(frozen=True)
class FusedOp:
    """One fused op: a primitive plus the rules that make it a first-class JAX citizen.

    Attributes:
      name: op name; the primitive is ``jax_w4a4_<name>`` and so is its FFI target.
      abstract_eval: validates operands, returns the result avals (a tuple iff multiple_results).
      reference: the CPU (and non-CUDA) lowering, same operands and params as the primitive.
      kernel_checks: extra trace-time checks of what the CUDA kernel serves (raises ValueError).
      num_activations: the first operands that carry the leading (token) dims; the rest are weights.
      num_results: how many arrays the primitive returns (more than one: it returns a tuple).
      cuda_scratch: for a kernel that needs device scratch, ``(avals_in, params) -> (avals, attributes)``:
        the CUDA lowering gives the FFI call these extra results, arrays that XLA allocates (so the call
        stays CUDA-graph safe), passes the attributes that planned them, and drops them.
    """

    name: str
    abstract_eval: Callable
    reference: Callable
    kernel_checks: Callable
    num_activations: int
    num_results: int
    cuda_scratch: Callable | None = None

    @property
    def multiple_results(self) -> bool:
        return self.num_results > 1

    @functools.cached_property
    def primitive(self) -> Primitive:
        prim = Primitive(_library.target_name(self.name))
        prim.multiple_results = self.multiple_results
        prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
        prim.def_abstract_eval(self.abstract_eval)
        reference_lowering = mlir.lower_fun(self.reference, self.multiple_results)
        mlir.register_lowering(prim, self._partitioned(reference_lowering))
        mlir.register_lowering(prim, self._partitioned(self._cuda_lowering), platform="cuda")
        # Over several devices the lowering is a custom_partitioning call, which needs the devices.
        dispatch.prim_requires_devices_during_lowering.add(prim)
        batching.primitive_batchers[prim] = self._batch
        return prim

    def _partitioned(self, local_lowering: Callable) -> Callable:
        """``local_lowering`` on one device; over several, the Shardy-ruled partitioning of
        :mod:`jax_w4a4.ops.partitioning` (whose per-device computation lowers locally)."""
        return partitioning.partitioned_lowering(self.name, self.bind, local_lowering, self.multiple_results)

    def bind(self, *operands: jax.Array, **params):
        return self.primitive.bind(*operands, **params)

    def _cuda_lowering(self, ctx, *operands, **params):
        _library.require_cuda_target(self.name)
        self.kernel_checks(*ctx.avals_in, **params)
        rule = jax.ffi.ffi_lowering(_library.target_name(self.name))
        if self.cuda_scratch is None:
            return rule(ctx, *operands, **params)
        scratch, attributes = self.cuda_scratch(*ctx.avals_in, **params)
        results = rule(ctx.replace(avals_out=(*ctx.avals_out, *scratch)), *operands, **params, **attributes)
        return results[: len(ctx.avals_out)]

    def _batch(self, operands, dims, **params):
        not_mapped = None  # the batch dim of an operand that vmap does not map
        size = next(x.shape[d] for x, d in zip(operands, dims) if d is not not_mapped)
        weights_batched = any(d is not not_mapped for d in dims[self.num_activations :])
        out_dims = (0,) * self.num_results if self.multiple_results else 0
        if not weights_batched:
            activations = [
                jnp.moveaxis(x, d, 0) if d is not not_mapped else jnp.broadcast_to(x, (size, *x.shape))
                for x, d in zip(operands[: self.num_activations], dims)
            ]
            return self.bind(*activations, *operands[self.num_activations :], **params), out_dims
        # Batched weights (e.g. a vmap over stacked layers): one call per batch element.
        batched = [jnp.moveaxis(x, d, 0) for x, d in zip(operands, dims) if d is not not_mapped]

        def one(slices):
            it = iter(slices)
            return self.bind(*(next(it) if d is not not_mapped else x for x, d in zip(operands, dims)), **params)

        return lax.map(one, batched), out_dims


# --------------------------------------------------------------------------------------------------
# act_quant


_act_group = partitioning.act_group


def _act_quant_abstract(x, smooth, lora_down, *, act_format, op="act_quant"):
    checks.one_of(op, "act_format", act_format, reference.ACT_FORMATS)
    checks.at_least_1d(op, "x", x)
    checks.dtype_in(op, "x", x, checks.HALF_DTYPES)
    k = x.shape[-1]
    group = _act_group(act_format)
    checks.multiple_of(op, "x.shape[-1] (K)", k, group, f" for act_format={act_format!r}")
    checks.shape_is(op, "smooth", smooth, (k,))
    checks.dtype_in(op, "smooth", smooth, [jnp.float32])
    checks.ndim_is(op, "lora_down", lora_down, 2)
    checks.shape_is(op, "lora_down", lora_down, (k, lora_down.shape[1]))
    checks.dtype_in(op, "lora_down", lora_down, [x.dtype])
    r = lora_down.shape[1]
    checks.rank(op, "lora_down.shape[1]", r)
    lead = x.shape[:-1]
    q = ShapedArray((*lead, k), jnp.uint8)  # one e4m3 code per value, every format
    scales = ShapedArray((*lead, k // group), jnp.float32 if act_format == "fp8" else x.dtype)
    return q, scales, ShapedArray((*lead, r), jnp.float32)


def _no_kernel_checks(*avals, **params) -> None:
    del avals, params


def _workspace(nbytes: int) -> list[ShapedArray]:
    """A kernel's scratch: one uint8 result of ``nbytes``."""
    return [ShapedArray((nbytes,), jnp.uint8)]


def _act_quant_workspace(x, smooth, lora_down, *, act_format):
    del smooth, act_format
    num_sms = _library.cuda_sm_count()
    plan = budget.act_quant_launch(math.prod(x.shape[:-1]), x.shape[-1], lora_down.shape[1], num_sms=num_sms)
    return _workspace(plan.workspace_bytes), {"num_sms": num_sms}


ACT_QUANT = FusedOp(
    name="act_quant",
    abstract_eval=_act_quant_abstract,
    reference=reference.act_quant,
    kernel_checks=_no_kernel_checks,
    num_activations=1,
    num_results=3,
    cuda_scratch=_act_quant_workspace,
)


def act_quant(
    x: jax.Array, smooth: jax.Array, lora_down: jax.Array, *, act_format: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fused smoothing + activation quantization + low-rank down projection (``LA = X · L_down``).

    See :func:`jax_w4a4.reference.act_quant` for the math and ``docs/layouts.md`` for the layouts.
    """
    return tuple(ACT_QUANT.bind(x, smooth, lora_down, act_format=act_format))


# --------------------------------------------------------------------------------------------------
# w4a4_gemm


def _w4a4_gemm_abstract(q_x, s_x, la, qweight, wscales, lora_up, alpha, bias, *, act_format, op="w4a4_gemm"):
    checks.one_of(op, "act_format", act_format, reference.ACT_FORMATS)
    # The prepacked weight scales (K/128, N, 2) give N and K (so K is a multiple of 128).
    checks.ndim_is(op, "wscales (prepacked, formats.svdq_layout.prepack_scales)", wscales, 3)
    checks.dtype_in(op, "wscales", wscales, checks.HALF_DTYPES)
    n, k = svdq_layout.prepacked_scales_sizes(wscales.shape)
    checks.shape_is(op, "wscales (prepacked, formats.svdq_layout.prepack_scales)", wscales,
                    svdq_layout.prepacked_scales_shape(n, k))
    checks.dtype_in(op, "qweight", qweight, [svdq_layout.PREPACKED_DTYPE])
    checks.shape_is(op, "qweight (prepacked, formats.svdq_layout)", qweight, svdq_layout.prepacked_shape(n, k))
    out_dtype = wscales.dtype
    for name, value in (("q_x", q_x), ("s_x", s_x), ("la", la)):
        checks.at_least_1d(op, name, value)
    lead = checks.same_leading_dims(op, ("q_x", "s_x", "la"), (q_x, s_x, la))
    group = _act_group(act_format)
    checks.dtype_in(op, "q_x", q_x, [jnp.uint8])
    checks.shape_is(op, "q_x", q_x, (*lead, k))
    checks.shape_is(op, "s_x", s_x, (*lead, k // group))
    checks.dtype_in(op, "s_x", s_x, [jnp.float32] if act_format == "fp8" else [out_dtype])
    checks.ndim_is(op, "lora_up", lora_up, 2)
    r = lora_up.shape[0]
    checks.rank(op, "lora_up.shape[0]", r)
    checks.shape_is(op, "lora_up", lora_up, (r, n))
    checks.dtype_in(op, "lora_up", lora_up, [out_dtype])
    checks.shape_is(op, "la", la, (*lead, r))
    checks.dtype_in(op, "la", la, [jnp.float32])
    checks.optional_vector(op, "alpha", alpha, n, [jnp.float32])
    checks.optional_vector(op, "bias", bias, n, [out_dtype])
    return ShapedArray((*lead, n), out_dtype)


W4A4_TILE_N = 128


def _w4a4_gemm_kernel_checks(q_x, s_x, la, qweight, wscales, *rest, act_format, op="w4a4_gemm"):
    why = " (the CUDA kernel's tile; pad the layer or run it on CPU)"
    checks.multiple_of(op, "N (wscales.shape[1])", wscales.shape[1], W4A4_TILE_N, why)


def _w4a4_gemm_reference(q_x, s_x, la, qweight, wscales, lora_up, alpha, bias, *, act_format):
    n, k = svdq_layout.prepacked_scales_sizes(wscales.shape)
    qweight = svdq_layout.unprepack(qweight, n, k)
    wscales = svdq_layout.unprepack_scales(wscales)
    return reference.w4a4_gemm(q_x, s_x, la, qweight, wscales, lora_up, alpha, bias, act_format=act_format)


def _w4a4_gemm_workspace(q_x, s_x, la, qweight, wscales, lora_up, alpha, bias, *, act_format):
    num_sms = _library.cuda_sm_count()
    m, n, k = math.prod(q_x.shape[:-1]), wscales.shape[1], q_x.shape[-1]
    return _workspace(budget.w4a4_workspace_bytes(m, n, k, num_sms=num_sms)), {"num_sms": num_sms}


W4A4_GEMM = FusedOp(
    name="w4a4_gemm",
    abstract_eval=_w4a4_gemm_abstract,
    reference=_w4a4_gemm_reference,
    kernel_checks=_w4a4_gemm_kernel_checks,
    num_activations=3,
    num_results=1,
    cuda_scratch=_w4a4_gemm_workspace,
)


def _empty(dtype) -> jax.Array:
    return jnp.zeros(EMPTY, dtype)


def w4a4_gemm(
    q_x: jax.Array,
    s_x: jax.Array,
    la: jax.Array,
    qweight: jax.Array,
    wscales: jax.Array,
    lora_up: jax.Array,
    alpha: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    act_format: str,
) -> jax.Array:
    """W4A4 GEMM with per-group scales, fused low-rank up projection, per-column α and bias β.

    ``qweight`` and ``wscales`` are in the kernel layouts of :mod:`jax_w4a4.formats.svdq_layout`
    (``prepack``: what the sm90 kernel's 16-byte fragment loads read; ``prepack_scales``: ``(K/128, N, 2)``,
    one contiguous row of scales per 128-column K-stage); the reference path unprepacks both. K is a
    multiple of 128.

    On the GPU, a call of :func:`jax_w4a4.budget.w4a4_expanded_weights_min_tokens` tokens or more first
    expands ``qweight`` to e4m3 codes in an N x K-byte scratch buffer that XLA allocates for the call (the
    long-prefill kernel reads them from shared memory instead of converting them); decode calls need the
    tokens' promotion records and the stream-K partials (:func:`jax_w4a4.budget.w4a4_workspace_bytes`).

    See :func:`jax_w4a4.reference.w4a4_gemm` for the math and ``docs/layouts.md`` for the layouts.
    """
    alpha = _empty(jnp.float32) if alpha is None else alpha
    bias = _empty(wscales.dtype) if bias is None else bias
    return W4A4_GEMM.bind(q_x, s_x, la, qweight, wscales, lora_up, alpha, bias, act_format=act_format)


# --------------------------------------------------------------------------------------------------
# w4a4_linear: act_quant then w4a4_gemm


def _w4a4_linear_abstract(x, smooth, lora_down, qweight, wscales, lora_up, alpha, bias, *, act_format):
    op = "w4a4_linear"
    activations = _act_quant_abstract(x, smooth, lora_down, act_format=act_format, op=op)
    checks.dtype_in(op, "wscales (the output dtype)", wscales, [x.dtype])
    return _w4a4_gemm_abstract(*activations, qweight, wscales, lora_up, alpha, bias, act_format=act_format, op=op)


def _w4a4_linear_kernel_checks(x, smooth, lora_down, *weights, act_format):
    activations = _act_quant_abstract(x, smooth, lora_down, act_format=act_format)
    _w4a4_gemm_kernel_checks(*activations, *weights, act_format=act_format, op="w4a4_linear")


def _w4a4_linear_reference(x, smooth, lora_down, *weights, act_format):
    activations = ACT_QUANT.bind(x, smooth, lora_down, act_format=act_format)
    return W4A4_GEMM.bind(*activations, *weights, act_format=act_format)


def _w4a4_linear_scratch(x, smooth, lora_down, *weights, act_format):
    """act_quant's three outputs and the two kernels' workspaces, results of the one FFI call."""
    activations = _act_quant_abstract(x, smooth, lora_down, act_format=act_format)
    act_quant_workspace, attributes = _act_quant_workspace(x, smooth, lora_down, act_format=act_format)
    gemm_workspace, _ = _w4a4_gemm_workspace(*activations, *weights, act_format=act_format)
    return [*activations, *act_quant_workspace, *gemm_workspace], attributes


W4A4_LINEAR = FusedOp(
    name="w4a4_linear",
    abstract_eval=_w4a4_linear_abstract,
    reference=_w4a4_linear_reference,  # the two ops, each lowered to its reference
    kernel_checks=_w4a4_linear_kernel_checks,
    num_activations=1,
    num_results=1,
    cuda_scratch=_w4a4_linear_scratch,
)


def w4a4_linear(
    x: jax.Array,
    smooth: jax.Array,
    lora_down: jax.Array,
    qweight: jax.Array,
    wscales: jax.Array,
    lora_up: jax.Array,
    alpha: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    act_format: str,
) -> jax.Array:
    """The whole W4A4 layer, :func:`act_quant` then :func:`w4a4_gemm`, as one primitive (one FFI call).

    Same operands, layouts and result as the two ops in sequence, bit for bit. On the GPU both kernels are
    launched by one call, the GEMM with programmatic dependent launch: its CTAs start and set up while
    act_quant runs, then load its codes as soon as they are stored, before its low-rank sum ends (two custom
    calls cannot overlap inside XLA's command buffers). Under ``jax.jit`` over several devices every device runs
    the one call on its shard (weights sharded on K: without β, then one psum and β once).
    """
    alpha = _empty(jnp.float32) if alpha is None else alpha
    bias = _empty(wscales.dtype) if bias is None else bias
    return W4A4_LINEAR.bind(x, smooth, lora_down, qweight, wscales, lora_up, alpha, bias, act_format=act_format)


# --------------------------------------------------------------------------------------------------
# w4a16_gemm


def _w4a16_gemm_abstract(x, qweight, scales, zeros, g_idx, bias, *, group_size):
    op = "w4a16_gemm"
    checks.at_least_1d(op, "x", x)
    checks.dtype_in(op, "x", x, checks.HALF_DTYPES)
    k = x.shape[-1]
    checks.ndim_is(op, "scales", scales, 2)
    groups, n = scales.shape  # the kernel layout (K/G, N): w4a16_layout.prepack_scales
    if group_size != k:
        checks.one_of(op, "group_size", group_size, (*w4a16.GROUP_SIZES, k))
    checks.multiple_of(op, "x.shape[-1] (K)", k, group_size, f" for group_size={group_size}")
    if scales.shape[1] == k // group_size != scales.shape[0]:
        checks.fail(op, f"scales {tuple(scales.shape)} look like the logical (N, K/G) layout; the kernel layout is "
                        f"(K/G, N) = {(k // group_size, scales.shape[0])}: convert with w4a16_layout.prepack_scales")
    checks.shape_is(op, "scales", scales, (k // group_size, n))
    checks.dtype_in(op, "scales", scales, [x.dtype])
    checks.shape_is(op, "qweight", qweight, w4a16_layout.prepacked_shape(n, k))
    checks.dtype_in(op, "qweight", qweight, [w4a16_layout.PREPACKED_DTYPE])
    if zeros.shape != EMPTY:
        checks.shape_is(op, "zeros", zeros, (groups, n))
        checks.dtype_in(op, "zeros", zeros, [jnp.uint8])
    checks.optional_vector(op, "g_idx", g_idx, k, [jnp.int32])
    checks.optional_vector(op, "bias", bias, n, [x.dtype])
    return ShapedArray((*x.shape[:-1], n), x.dtype)


def _w4a16_gemm_kernel_checks(x, qweight, scales, *rest, group_size):
    w4a16_layout.check_shape(scales.shape[1], x.shape[-1], group_size)


def _w4a16_gemm_workspace(x, qweight, scales, zeros, g_idx, bias, *, group_size):
    num_sms = _library.cuda_sm_count()
    m, n, k = math.prod(x.shape[:-1]), scales.shape[1], x.shape[-1]
    nbytes = budget.w4a16_workspace_bytes(m, n, k, group_size, act_order=g_idx.shape != EMPTY, num_sms=num_sms)
    return _workspace(max(nbytes, 0)), {"num_sms": num_sms}


def _w4a16_gemm_reference(x, qweight, scales, zeros, g_idx, bias, *, group_size):
    logical = w4a16_layout.unprepack(qweight, scales.shape[1], x.shape[-1])
    zeros = zeros if zeros.shape == EMPTY else w4a16_layout.unprepack_scales(zeros)
    return reference.w4a16_gemm(
        x, logical, w4a16_layout.unprepack_scales(scales), zeros, g_idx, bias, group_size=group_size
    )


W4A16_GEMM = FusedOp(
    name="w4a16_gemm",
    abstract_eval=_w4a16_gemm_abstract,
    reference=_w4a16_gemm_reference,
    kernel_checks=_w4a16_gemm_kernel_checks,
    num_activations=1,
    num_results=1,
    cuda_scratch=_w4a16_gemm_workspace,
)


def w4a16_gemm(
    x: jax.Array,
    qweight: jax.Array,
    scales: jax.Array,
    zeros: jax.Array | None = None,
    g_idx: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    group_size: int,
) -> jax.Array:
    """``Y = X · dequant(Q(W))ᵀ + β`` with the weights in the kernel layouts of :mod:`formats.w4a16_layout`:
    ``qweight`` from ``prepack``, ``scales`` ``(K/G, N)`` and the optional uint8 ``zeros`` ``(K/G, N)`` from
    ``prepack_scales``.

    ``group_size`` is the real group size (K for per-channel).
    """
    zeros = _empty(jnp.uint8) if zeros is None else zeros
    g_idx = _empty(jnp.int32) if g_idx is None else g_idx
    bias = _empty(x.dtype) if bias is None else bias
    return W4A16_GEMM.bind(x, qweight, scales, zeros, g_idx, bias, group_size=group_size)


ALL_OPS: Sequence[FusedOp] = (ACT_QUANT, W4A4_GEMM, W4A4_LINEAR, W4A16_GEMM)
