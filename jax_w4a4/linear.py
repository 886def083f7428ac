"""``linear(x, weights)``: the quantized linear layer, dispatching on the weights type."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_w4a4 import ops
from jax_w4a4.ops import checks
from jax_w4a4.reference import HIGHEST
from jax_w4a4.sharding import TensorParallelWeights, tensor_parallel_linear
from jax_w4a4.weights import FakeQuantFP4Weights, QuantizedWeights, SVDQuantWeights, W4A16Weights


def _check_input(x: jax.Array, weights: QuantizedWeights) -> None:
    checks.at_least_1d("linear", "x", x)
    if x.shape[-1] != weights.in_features:
        checks.fail("linear", f"x.shape[-1] must be in_features={weights.in_features}, got {x.shape[-1]}")
    if jnp.dtype(x.dtype) != weights.dtype:
        checks.fail(
            "linear",
            f"x must have the layer's dtype {weights.dtype.name} (quantize_linear(..., dtype=...)), "
            f"got {jnp.dtype(x.dtype).name}",
        )


def linear(x: jax.Array, weights: QuantizedWeights) -> jax.Array:
    """Applies a quantized linear layer: ``(..., K) -> (..., N)`` in x's dtype.

    W4A4 / W4A8 weights run the fused activation quantization then the W4A4 GEMM with the low-rank
    branch (one op, :func:`jax_w4a4.ops.w4a4_linear`: on the GPU the GEMM starts while the quantization runs);
    W4A16 weights run the weight-only GEMM. On a GPU these are the CUDA kernels, elsewhere the
    reference math. SVDQuantWeights hold the weight zero-padded to the kernel's multiples of 128:
    ``x`` gets zero columns up to the padded K and the output is cut back to the logical N, on every
    platform (exact: see :class:`jax_w4a4.SVDQuantWeights`). FakeQuantFP4Weights (nvfp4 / mxfp4)
    have no kernel: they always run as XLA ops (dequantize, then an fp32 dot). Works under
    ``jax.jit``, ``jax.vmap`` and ``jax.export``.
    Weights placed by :func:`jax_w4a4.sharding.shard_weights` run tensor parallel (``shard_map``);
    weights placed by hand with ``NamedSharding`` partition themselves under ``jax.jit`` (each op's
    Shardy rule, :mod:`jax_w4a4.ops.partitioning`): column, row or data parallel, weights not moved.
    """
    if isinstance(weights, TensorParallelWeights):
        _check_input(x, weights)
        return tensor_parallel_linear(x, weights)
    if isinstance(weights, SVDQuantWeights):
        _check_input(x, weights)
        x = weights.pad_input(x)  # the arrays are padded to the kernel's multiples (SVDQuantWeights)
        y = ops.w4a4_linear(
            x, weights.smooth, weights.lora_down, weights.qweight, weights.wscales, weights.lora_up,
            weights.alpha, weights.bias, act_format=weights.act_format,
        )
        return weights.crop_output(y)
    if isinstance(weights, W4A16Weights):
        _check_input(x, weights)
        return ops.w4a16_gemm(
            x, weights.qweight, weights.scales, weights.zeros, weights.g_idx, weights.bias,
            group_size=weights.group_size,
        )
    if isinstance(weights, FakeQuantFP4Weights):
        _check_input(x, weights)
        return _fake_quant_fp4_linear(x, weights)
    raise TypeError(
        "jax_w4a4.linear: weights must be SVDQuantWeights, W4A16Weights or FakeQuantFP4Weights, "
        f"got {type(weights).__name__}"
    )


def _fake_quant_fp4_linear(x: jax.Array, weights: FakeQuantFP4Weights) -> jax.Array:
    """nvfp4 / mxfp4 weights as XLA ops (no Hopper kernel): dequantize, fp32 dot, output in x's dtype."""
    acc = jnp.einsum("...k,nk->...n", x.astype(jnp.float32), weights.dequantize(), precision=HIGHEST)
    if weights.bias is not None:
        acc = acc + weights.bias.astype(jnp.float32)
    return acc.astype(x.dtype)
