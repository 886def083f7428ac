"""w4a16_gemm on the GPU (csrc/kernels/sm90/w4a16_gemm.cu) against jax_w4a4.reference.w4a16_gemm: the decode
shapes at every token count, every format, act-order, every token tile, leading dims, N not a multiple of a warp's
rows, and a g_idx that does not match the weights. The launch forms (narrow CTAs and their K-split clusters, K
phases, whole-SM CTAs) and the split-K reductions: test_w4a16_forms_gpu.py. How kernel and reference are compared:
w4a16_support.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_w4a4 import budget
from tests.gpu.w4a16_support import BF16, FP16, activations, kernel, num_sms, run_and_compare, weights

pytestmark = pytest.mark.gpu

TOKENS = (1, 3, 16, 33, 64, 200)

# One configuration per decode shape (together they cover every group size, both zero-point modes,
# act-order, bias, bf16 and fp16), each at every token count.
SHAPE_CONFIGS = [
    # (n, k, group_size, zero_point, dtype, act_order, bias)
    (4096, 4096, 32, True, BF16, False, True),
    (8192, 8192, 128, True, FP16, True, True),
    (28672, 8192, 128, False, BF16, False, False),
    (8192, 28672, 64, True, BF16, True, False),
    (576, 1536, -1, False, FP16, False, True),
    (1536, 576, 32, True, BF16, True, False),
]


@pytest.mark.parametrize("config", SHAPE_CONFIGS, ids=lambda c: f"{c[0]}x{c[1]}-g{c[2]}-{'zp' if c[3] else 'sym'}-{jnp.dtype(c[4]).name}{'-act' if c[5] else ''}")
@pytest.mark.parametrize("m", TOKENS)
def test_decode_shapes(config, m):
    n, k, group_size, zero_point, dtype, act_order, with_bias = config
    run_and_compare(activations((m,), k, dtype), n, k, group_size, zero_point, dtype, act_order, with_bias)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("zero_point", [False, True], ids=["sym", "zp"])
def test_every_format(dtype, group_size, zero_point):
    n, k = 576, 1536
    for m in (1, 33):
        run_and_compare(activations((m,), k, dtype, seed=m), n, k, group_size, zero_point, dtype, False, True)


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_every_group_size_with_act_order(group_size):
    n, k = 576, 1536
    dtype = BF16 if group_size in (32, 128) else FP16
    for m in (1, 33):
        run_and_compare(activations((m,), k, dtype, seed=m), n, k, group_size, group_size != 64, dtype, True, True)


@pytest.mark.parametrize("n, form", [(4256, "narrow"), (8480, "wide")], ids=["narrow", "wide"])
def test_rows_not_a_multiple_of_a_warps_tiles(n, form):
    """N % 64 == 32: up to 16 tokens a warp of a narrow or wide CTA owns four m16 tiles (64 rows), so the last
    warp holds only one valid pair of tiles (it loads that pair twice and stores it once)."""
    k = 1024
    assert [budget.w4a16_launch(m, n, k, 64, act_order=False, num_sms=num_sms()).form for m in (1, 16)] == [form] * 2
    for m, dtype in ((1, BF16), (16, FP16), (33, BF16)):
        run_and_compare(activations((m,), k, dtype, seed=m), n, k, 64, True, dtype, False, True)


@pytest.mark.parametrize("m", [8, 9, 24, 32])
def test_every_token_tile(m):
    """Every token tile the kernel instantiates, at and just past their edges: 8 and 16 tokens (mma.sync, one
    and two token tiles; 9 runs the 16-token tile), 32 and 64 (wgmma of that width; 24 and 32 run the
    32-token tile, which the decode shapes skip)."""
    n, k = 1056, 2048
    for dtype in (BF16, FP16):
        run_and_compare(activations((m,), k, dtype, seed=m), n, k, 128, m % 2 == 0, dtype, False, True)


def test_leading_dims_and_small_split_k():
    """x (..., K): the leading dims are flattened; 14336 x 4096 runs split-K over 8 CTAs per column tile
    (the plan for 6 tokens on 132 SMs)."""
    assert budget.w4a16_launch(6, 14336, 4096, 64, act_order=False, num_sms=num_sms()).splits == 8
    x = activations((2, 3), 4096, BF16)
    run_and_compare(x, 14336, 4096, 64, True, BF16, False, True)



def test_mismatched_act_order_gives_nan_not_a_wrong_answer():
    n, k = 576, 1536
    _, packed, scales, zeros, g_idx, bias = weights(n, k, 64, False, BF16, True)
    x = activations((4,), k, BF16)
    # Prepacked with act-order but called without g_idx.
    y = np.asarray(kernel(x, packed, scales, zeros, None, bias, group_size=64).astype(jnp.float32))
    assert np.isnan(y).all()
    # Called with a g_idx that is not the one the weights were prepacked with.
    wrong = jnp.roll(g_idx, 1)
    y = np.asarray(kernel(x, packed, scales, zeros, wrong, bias, group_size=64).astype(jnp.float32))
    assert np.isnan(y).all()
