"""Shared pieces of the w4a16_gemm GPU tests (test_w4a16_gemm_gpu.py, test_w4a16_forms_gpu.py): quantized random
weights, activations, the kernel and the reference under jax.jit, and the comparison.

The kernel runs through jax_w4a4.ops.w4a16_gemm under jax.jit with the prepacked weights; the
reference gets the logical weights and runs as plain XLA (fp32, precision HIGHEST) on the same GPU,
on the same quantized weights (formats.w4a16.quantize). The kernel promotes fp32 partial sums of
exact products with fp32 scales (up to 16 bf16 tokens the partials carry a 128·Σx offset that the
promotion subtracts, which costs ~7 bits of the partial's fp32 precision), so it differs from the
reference by fp32 summation order and the final rounding: the tolerances below are far tighter than a
wrong scale, zero, group or row would pass.
Before each kernel run the allocator is filled with NaN buffers of the output's size, so an element
the kernel forgot to write shows up as non-finite.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_w4a4 import ops, reference
from jax_w4a4.formats import w4a16, w4a16_layout
from jax_w4a4.ops import _library

BF16, FP16 = jnp.bfloat16, jnp.float16
# Relative Frobenius error and worst element (relative to max |reference|), per output dtype.
TOLERANCE = {jnp.dtype(BF16): (2e-3, 1e-2), jnp.dtype(FP16): (5e-4, 2e-3)}


def gpu():
    return jax.devices("cuda")[0]


def num_sms():
    return _library.cuda_sm_count()


@functools.cache
def weights(n, k, group_size, zero_point, dtype, act_order, seed=0):
    """Quantized random weights (on the GPU): logical and prepacked forms, scales, zeros, g_idx."""
    key = jax.random.key(seed)
    with jax.default_device(gpu()):
        w = jax.random.normal(key, (n, k), jnp.float32) * jnp.exp2(
            jax.random.uniform(jax.random.fold_in(key, 1), (n, 1), jnp.float32, -2, 2)
        )
        size = k if group_size == -1 else group_size
        g_idx = None
        if act_order:  # GPTQ act-order: groups are consecutive runs of a random column order
            order = jax.random.permutation(jax.random.fold_in(key, 2), k)
            g_idx = (jnp.argsort(order) // size).astype(jnp.int32)
        q = jax.jit(w4a16.quantize, static_argnames=("group_size", "zero_point", "scale_dtype"))(
            w, group_size=group_size, zero_point=zero_point, scale_dtype=dtype, g_idx=g_idx
        )
        prepack = jax.jit(w4a16_layout.prepack, static_argnames="group_size")
        packed = prepack(q.qweight) if g_idx is None else prepack(q.qweight, g_idx=g_idx, group_size=group_size)
        bias = jax.random.normal(jax.random.fold_in(key, 3), (n,), jnp.float32).astype(dtype)
        return jax.block_until_ready((q.qweight, packed, q.scales, q.zeros, g_idx, bias))


def activations(lead, k, dtype, seed=1):
    x = jax.random.normal(jax.random.key(seed), (*lead, k), jnp.float32)
    return jax.device_put(x.astype(dtype), gpu())


def poison_allocator(shape, dtype):
    """Allocate and free output-sized NaN buffers, which the kernel's output then reuses."""
    bufs = [jnp.full(shape, jnp.nan, dtype, device=gpu()) for _ in range(2)]
    jax.block_until_ready(bufs)
    del bufs


@functools.partial(jax.jit, static_argnames="group_size")
def kernel(x, packed, scales, zeros, g_idx, bias, *, group_size):
    """The kernel on logical (N, K/G) scales and zeros, put in the kernel layout first."""
    zeros = None if zeros is None else w4a16_layout.prepack_scales(zeros)
    return ops.w4a16_gemm(x, packed, w4a16_layout.prepack_scales(scales), zeros, g_idx, bias, group_size=group_size)


@functools.partial(jax.jit, static_argnames="group_size")
def reference_gemm(x, qweight, scales, zeros, g_idx, bias, *, group_size):
    return reference.w4a16_gemm(x, qweight, scales, zeros, g_idx, bias, group_size=group_size)


def run_and_compare(x, n, k, group_size, zero_point, dtype, act_order, with_bias):
    qweight, packed, scales, zeros, g_idx, bias = weights(n, k, group_size, zero_point, dtype, act_order)
    bias = bias if with_bias else None
    size = k if group_size == -1 else group_size
    poison_allocator((*x.shape[:-1], n), dtype)
    y = np.asarray(kernel(x, packed, scales, zeros, g_idx, bias, group_size=size).astype(jnp.float32))
    ref = np.asarray(reference_gemm(x, qweight, scales, zeros, g_idx, bias, group_size=size).astype(jnp.float32))
    assert y.shape == (*x.shape[:-1], n)
    assert np.isfinite(y).all(), f"{np.size(y) - np.isfinite(y).sum()} non-finite outputs"
    frobenius, worst = TOLERANCE[jnp.dtype(dtype)]
    err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    max_err = np.abs(y - ref).max() / np.abs(ref).max()
    assert err < frobenius and max_err < worst, f"relative error {err:.2e}, worst element {max_err:.2e}"
    return y

