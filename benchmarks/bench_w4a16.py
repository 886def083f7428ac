"""Benchmark of w4a16_gemm (weight-only int4, MARLIN class) at decode token counts.

Memory-bound: the floor is the int4 weights plus their scales over the H200's 4.2 TB/s. Printed per
(N x K, M): our time, effective weight bandwidth (weights + scales bytes / time) and its share of
4.2 TB/s, and the peers measured in this process as ratios (peer time / our time, > 1 = we are
faster): jnp.dot bf16 (XLA), torch cuBLAS bf16 and torch._weight_int4pack_mm (tinygemm, int4 g128)
where torch is importable. A second table runs the other formats (group sizes, zero points,
act-order, fp16) on the largest shape at 1 and 16 tokens.

Timing: benchmarks/harness.py — one jit of R chained calls cycling through several weight sets (at
least 3, and more than L2 holds in total), timed on the GPU by the device clock, median over trials;
torch peers with CUDA events, cycling through their own sets the same way. Each call of a chain gets its
own activation copy as its first input (the one the harness passes through the barrier), as in
bench_w4a4: with one activation closed over as a constant, XLA merged or deduplicated the 1-token
jnp.dot calls (Triton GEMV fusions), so that column read 470 MB in 42 µs (session 12).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks import harness
from jax_w4a4 import ops
from jax_w4a4.formats import w4a16
from jax_w4a4.weights import W4A16Weights

SHAPES = [(28672, 8192), (8192, 28672), (8192, 8192), (4096, 4096)]
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128]
GROUP = 128
MIN_SETS = 3
CALLS = 10  # calls per timed chain, each with its own activation copy


def weight_bytes(n: int, k: int, group_size: int, zero_point: bool) -> int:
    groups = k // group_size
    return n * k // 2 + n * groups * 2 + (n * groups if zero_point else 0)


@functools.partial(jax.jit, static_argnames=("n", "k", "group_size", "zero_point", "dtype", "act_order"))
def make_weights(key, n, k, *, group_size, zero_point, dtype, act_order):
    w = jax.random.normal(key, (n, k), jnp.float32)
    g_idx = None
    if act_order:
        g_idx = (jnp.argsort(jax.random.permutation(jax.random.fold_in(key, 1), k)) // group_size).astype(jnp.int32)
    q = w4a16.quantize(w, group_size=group_size, zero_point=zero_point, scale_dtype=dtype, g_idx=g_idx)
    weights = W4A16Weights.from_logical(q.qweight, q.scales, q.zeros, g_idx=g_idx, group_size=group_size)
    return weights.qweight, weights.scales, weights.zeros, g_idx


def weight_sets(n, k, *, group_size=GROUP, zero_point=False, dtype=jnp.bfloat16, act_order=False):
    count = harness.rotations(weight_bytes(n, k, group_size, zero_point), minimum=MIN_SETS)
    key = jax.random.key(n * 7 + k)
    return [
        jax.block_until_ready(
            make_weights(jax.random.fold_in(key, i), n, k, group_size=group_size, zero_point=zero_point,
                         dtype=dtype, act_order=act_order)
        )
        for i in range(count)
    ]


def chained(m, k, dtype, weight_sets):
    """CALLS input sets (x, *weights): a fresh activation per call, the weight sets cycled."""
    key = jax.random.key(m)
    xs = [jax.random.normal(jax.random.fold_in(key, i), (m, k), jnp.float32).astype(dtype) for i in range(CALLS)]
    return [(x, *weight_sets[i % len(weight_sets)]) for i, x in enumerate(xs)]


def time_ours(m, k, sets, group_size, dtype):
    fn = functools.partial(ops.w4a16_gemm, group_size=group_size)
    return harness.time_jax(fn, chained(m, k, dtype, sets), calls=CALLS, trials=5)


def time_jnp_dot(m, n, k, cache):
    if (n, k) not in cache:
        count = harness.rotations(n * k * 2, minimum=MIN_SETS)
        key = jax.random.key(n + k)
        cache[(n, k)] = [
            (jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.float32).astype(jnp.bfloat16),)
            for i in range(count)
        ]
    dot = lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)
    return harness.time_jax(dot, chained(m, k, jnp.bfloat16, cache[(n, k)]), calls=CALLS, trials=5)


class TorchPeers:
    """torch cuBLAS bf16 and tinygemm int4 (torch._weight_int4pack_mm), if torch is importable."""

    def __init__(self):
        try:
            import torch

            self.torch = torch if torch.cuda.is_available() else None
        except ImportError:
            self.torch = None
        self.sets = {}
        self.int4_error = None

    def _weights(self, n, k):
        torch = self.torch
        if (n, k) not in self.sets:
            bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                    for _ in range(harness.rotations(n * k * 2, minimum=MIN_SETS))]
            int4 = []
            try:
                for _ in range(harness.rotations(n * k // 2, minimum=MIN_SETS)):
                    q = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.int32)
                    packed_u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
                    packed = torch._convert_weight_to_int4pack(packed_u8, 8)
                    scales_zeros = torch.rand(k // GROUP, n, 2, device="cuda", dtype=torch.bfloat16)
                    int4.append((packed, scales_zeros))
            except Exception as error:  # the private op's signature moves between torch versions
                self.int4_error = f"{type(error).__name__}: {error}"
                int4 = []
            self.sets[(n, k)] = (bf16, int4)
        return self.sets[(n, k)]

    def time(self, m, n, k):
        if self.torch is None:
            return None, None
        torch = self.torch
        bf16, int4 = self._weights(n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        t_bf16 = harness.time_torch(lambda i: torch.matmul(x, bf16[i].t()), len(bf16))
        t_int4 = None
        if int4:
            t_int4 = harness.time_torch(lambda i: torch._weight_int4pack_mm(x, int4[i][0], GROUP, int4[i][1]), len(int4))
        return t_bf16, t_int4


def us(seconds):
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--main-only", action="store_true", help="skip the second table (other formats)")
    args = parser.parse_args()
    print(f"devices: {jax.devices()}")
    print(harness.jax_timing())
    torch_peers = TorchPeers()
    dot_cache = {}
    rows = []
    for n, k in SHAPES:
        sets = weight_sets(n, k)
        wbytes = weight_bytes(n, k, GROUP, False)
        for m in TOKENS:
            ours = time_ours(m, k, sets, GROUP, jnp.bfloat16)
            dot = time_jnp_dot(m, n, k, dot_cache)
            t_bf16, t_int4 = torch_peers.time(m, n, k)
            floor = wbytes / harness.HBM_BYTES_PER_S
            rows.append(harness.Row(f"{n}x{k} M={m}", {
                "us": us(ours),
                "weight GB/s": f"{wbytes / ours / 1e9:.0f}",
                "% of 4.2 TB/s": f"{100 * floor / ours:.0f}%",
                "vs jnp.dot bf16": harness.fmt_ratio(ours, dot),
                "vs cuBLAS bf16": harness.fmt_ratio(ours, t_bf16),
                "vs int4pack_mm": harness.fmt_ratio(ours, t_int4),
                "cuBLAS us": us(t_bf16),
            }))
        del sets
    harness.print_table("w4a16_gemm, bf16, g128 symmetric (time, weight bandwidth, speedups)", rows)
    if torch_peers.int4_error:
        print(f"torch._weight_int4pack_mm unavailable: {torch_peers.int4_error}")

    if args.main_only:
        return
    n, k = SHAPES[0]
    rows = []
    for group_size, zero_point, dtype, act_order in [
        (32, True, jnp.bfloat16, False),
        (64, False, jnp.bfloat16, False),
        (128, True, jnp.float16, False),
        (128, False, jnp.bfloat16, True),
        (k, False, jnp.bfloat16, False),
    ]:
        sets = weight_sets(n, k, group_size=group_size, zero_point=zero_point, dtype=dtype, act_order=act_order)
        wbytes = weight_bytes(n, k, group_size, zero_point)
        label = f"g{group_size if group_size != k else 'K'} {'zp' if zero_point else 'sym'} {jnp.dtype(dtype).name}{' act' if act_order else ''}"
        for m in (1, 16):  # decode; 64 tokens were dropped to keep benchmarks/gpu_check.sh under 8 minutes
            ours = time_ours(m, k, sets, group_size, dtype)
            rows.append(harness.Row(f"{label} M={m}", {
                "us": us(ours),
                "weight GB/s": f"{wbytes / ours / 1e9:.0f}",
                "% of 4.2 TB/s": f"{100 * wbytes / harness.HBM_BYTES_PER_S / ours:.0f}%",
            }))
        del sets
    harness.print_table(f"w4a16_gemm formats on {n}x{k}", rows)


if __name__ == "__main__":
    main()
