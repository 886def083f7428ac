"""Run each CUDA kernel once at its benchmark shapes, for Nsight Compute (ncu) to profile.

    ncu --clock-control none -k regex:'W4A4|W4a16|ActQuant|ExpandWeights' python benchmarks/profile_kernels.py [case ...]

Cases: w4a4_prefill (8192³, rank 32), w4a4_decode / w4a4_decode16 (1 / 16 x 28672 x 8192), act_quant (4096 x 4096, rank 32),
w4a16_m1 / w4a16_m16 / w4a16_m32 / w4a16_m64 (28672 x 8192, g128), w4a16_8k_m1 / w4a16_8k_m16 (8192 x 8192, g128). Each case compiles, warms up once, then runs once more, so
the profiled launch is a steady-state one (pass `--launch-skip` per kernel to ncu to pick it).
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_w4a4 import ops
from jax_w4a4.formats import svdq, svdq_layout, w4a16
from jax_w4a4.weights import W4A16Weights

RANK = 32


def _w4a4_setup(n: int, k: int, key: jax.Array):
    """The jitted act_quant (rank 32, int4) and random weights in the kernel layouts (prepacked, wscales, lora_up)."""
    kw, ks, kd, ku = jax.random.split(key, 4)
    smooth = jax.random.uniform(ks, (k,), jnp.float32, 0.5, 2.0)
    lora_down = (jax.random.normal(kd, (k, RANK)) / np.sqrt(k)).astype(jnp.bfloat16)
    qweight, wscales = jax.jit(svdq.quantize_weights, static_argnames="scale_dtype")(
        jax.random.normal(kw, (n, k)) / np.sqrt(k), scale_dtype=jnp.bfloat16)
    prepacked, wscales = jax.jit(svdq_layout.prepack)(qweight), jax.jit(svdq_layout.prepack_scales)(wscales)
    lora_up = (jax.random.normal(ku, (RANK, n)) / np.sqrt(RANK)).astype(jnp.bfloat16)
    quantize = jax.jit(lambda x: ops.act_quant(x, smooth, lora_down, act_format="int4"))
    return quantize, (prepacked, wscales, lora_up)


def _w4a4_gemm(acts, prepacked, wscales, lora_up):
    return ops.w4a4_gemm(*acts, prepacked, wscales, lora_up, act_format="int4")


def _w4a4(m: int, n: int, k: int):
    key = jax.random.key(m + n + k)
    quantize, weights = _w4a4_setup(n, k, key)
    x = jax.random.normal(jax.random.fold_in(key, 1), (m, k), jnp.bfloat16)
    gemm = jax.jit(_w4a4_gemm)
    return lambda: gemm(quantize(x), *weights)


def _w4a16(m: int, n: int, k: int):
    key = jax.random.key(m + n + k)
    q = jax.jit(w4a16.quantize, static_argnames=("group_size", "zero_point", "scale_dtype"))(
        jax.random.normal(key, (n, k)), group_size=128, zero_point=False, scale_dtype=jnp.bfloat16)
    weights = jax.jit(functools.partial(W4A16Weights.from_logical, group_size=128))(q.qweight, q.scales)
    x = jax.random.normal(jax.random.fold_in(key, 1), (m, k), jnp.bfloat16)
    gemm = jax.jit(lambda x: ops.w4a16_gemm(x, weights.qweight, weights.scales, group_size=128))
    return lambda: gemm(x)


def _w4a4_chain(m: int = 1, n: int = 28672, k: int = 8192):
    """The benchmark harness's chain (4 calls) around the decode GEMM: shows every kernel XLA runs per call."""
    from benchmarks import harness

    key = jax.random.key(3)
    quantize, weights = _w4a4_setup(n, k, key)
    acts = [quantize(jax.random.normal(jax.random.fold_in(key, i), (m, k), jnp.bfloat16)) for i in range(4)]
    return lambda: harness.time_jax(_w4a4_gemm, [(a, *weights) for a in acts], calls=4, trials=1)


CASES = {
    "w4a4_prefill": lambda: _w4a4(8192, 8192, 8192),
    "w4a4_decode": lambda: _w4a4(1, 28672, 8192),
    "w4a4_decode16": lambda: _w4a4(16, 28672, 8192),
    "act_quant": lambda: _w4a4(4096, 4096, 4096),  # act_quant's profiled launch is this case's
    "w4a16_m1": lambda: _w4a16(1, 28672, 8192),
    "w4a16_m16": lambda: _w4a16(16, 28672, 8192),
    "w4a16_m32": lambda: _w4a16(32, 28672, 8192),
    "w4a16_m64": lambda: _w4a16(64, 28672, 8192),
    "w4a16_8k_m1": lambda: _w4a16(1, 8192, 8192),
    "w4a16_8k_m16": lambda: _w4a16(16, 8192, 8192),
    "w4a4_chain": _w4a4_chain,
}


def main(names: list[str]) -> None:
    for name in names or list(CASES):
        run = CASES[name]()
        jax.block_until_ready(run())
        jax.block_until_ready(run())
        print(f"ran {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
