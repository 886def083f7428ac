"""The executable spec: pure-JAX reference math of every fused op, fp32 accumulation.

Each function here has the signature of the primitive of the same name in :mod:`jax_w4a4.ops` and
computes exactly what the numeric contract (``docs/layouts.md``, design §2) says. The CPU lowering of
every primitive *is* this code, and every CUDA kernel is tested against it on the same quantized values.
Optional operands may be ``None`` or empty ``(0,)`` arrays (the form the primitives pass).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_w4a4.formats import fp8, svdq, w4a16
from jax_w4a4.formats.int4 import div_rn, unpack_int4

HIGHEST = lax.Precision.HIGHEST
ACT_FORMATS = ("int4", "uint4", "fp8")


def _present(operand: jax.Array | None) -> bool:
    return operand is not None and operand.size > 0


def _lowrank(la: jax.Array, lora_up: jax.Array, out_dtype) -> jax.Array:
    """(LA · L_up) in fp32, with LA rounded to the output dtype first, as the tensor cores consume it."""
    la_rounded = la.astype(out_dtype).astype(jnp.float32)
    return jnp.einsum("...r,rn->...n", la_rounded, lora_up.astype(jnp.float32), precision=HIGHEST)


def act_quant(
    x: jax.Array, smooth: jax.Array, lora_down: jax.Array, *, act_format: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Smooth, quantize and down-project activations in one pass.

    Args:
      x: ``(..., K)`` bf16/fp16 activations.
      smooth: ``(K,)`` fp32 smoothing factors λ; the quantized operand is ``X̂ = X / λ``.
      lora_down: ``(K, r)`` low-rank down projection in x's dtype (r may be 0).
      act_format: ``"int4"`` / ``"uint4"`` (group 64, scales in x's dtype) or ``"fp8"`` (e4m3, group 128,
        fp32 scales).

    Returns:
      ``(q, scales, la)``: one e4m3 code per value (uint8, for every format: int4/uint4 values are
      integers, exact in e4m3), per-group scales, and ``LA = X · L_down`` in fp32 (computed from the
      unsmoothed X).
    """
    x_hat = div_rn(x, smooth)
    if act_format == "fp8":
        q, scales = fp8.quantize_activations(x_hat)
    else:
        unsigned = act_format == "uint4"
        packed, scales = svdq.quantize_activations(x_hat, scale_dtype=x.dtype, unsigned=unsigned)
        q = svdq.to_e4m3_codes(packed, signed=not unsigned)
    la = jnp.einsum(
        "...k,kr->...r", x.astype(jnp.float32), lora_down.astype(jnp.float32), precision=HIGHEST
    )
    return q, scales, la


def _activation_group_scales(s_x: jax.Array, act_format: str) -> jax.Array:
    """Activation scales repeated to one per weight group of 64 (fp8 groups span two)."""
    group = fp8.GROUP_SIZE if act_format == "fp8" else svdq.GROUP_SIZE
    return jnp.repeat(s_x.astype(jnp.float32), group // svdq.GROUP_SIZE, -1)


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
    """``Y = α ⊙ Σ_g s_x s_w Σ_{k∈g} q_x q_w + (LA · L_up) + β`` in fp32, output in wscales' dtype.

    The group partial sums are accumulated group by group (the order of the kernels' promotion), so
    memory stays at one ``(..., N)`` accumulator whatever the number of groups.
    """
    out_dtype = wscales.dtype
    n, k = qweight.shape[0], qweight.shape[1] * 2
    groups = k // svdq.GROUP_SIZE
    x_values = fp8.from_e4m3_bits(q_x, "q_x")
    x_scales = _activation_group_scales(s_x, act_format)
    lead = x_values.shape[:-1]
    x_groups = jnp.moveaxis(x_values.reshape(*lead, groups, svdq.GROUP_SIZE), -2, 0)
    x_scales = jnp.moveaxis(x_scales, -1, 0)
    w_groups = jnp.moveaxis(
        unpack_int4(qweight, signed=True).astype(jnp.float32).reshape(n, groups, svdq.GROUP_SIZE), 1, 0
    )
    w_scales = wscales.astype(jnp.float32).T

    def add_group(acc, group):
        xg, sxg, wg, swg = group
        partial = jnp.einsum("...k,nk->...n", xg, wg, precision=HIGHEST)
        return acc + partial * (sxg[..., None] * swg), None

    acc = jnp.zeros((*lead, n), jnp.float32)
    acc, _ = lax.scan(add_group, acc, (x_groups, x_scales, w_groups, w_scales))
    if _present(alpha):
        acc = acc * alpha.astype(jnp.float32)
    if lora_up.shape[0] > 0:
        acc = acc + _lowrank(la, lora_up, out_dtype)
    if _present(bias):
        acc = acc + bias.astype(jnp.float32)
    return acc.astype(out_dtype)


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
    """``Y = X · Ŵᵀ + β`` with ``Ŵ[n,k] = (q − z[n,g(k)]) · s[n,g(k)]``, fp32 accumulation.

    ``qweight`` is the logical ``(N, K/2)`` uint8 layout (the primitive unprepacks the kernel layout
    before calling this). ``group_size`` equal to K means per-channel.
    """
    w_hat = w4a16.dequantize(
        qweight,
        scales,
        zeros if _present(zeros) else None,
        group_size=group_size,
        g_idx=g_idx if _present(g_idx) else None,
    )
    acc = jnp.einsum("...k,nk->...n", x.astype(jnp.float32), w_hat, precision=HIGHEST)
    if _present(bias):
        acc = acc + bias.astype(jnp.float32)
    return acc.astype(x.dtype)
