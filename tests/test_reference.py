"""The JAX reference (the executable spec) against the independent float64 NumPy spec."""

import jax
import ml_dtypes
import numpy as np
import pytest

from jax_w4a4 import reference
from tests import numpy_spec as spec

HALF = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _random_x(rng, shape, dtype, nonnegative=False):
    x = rng.standard_normal(shape).astype(np.float32) * 2.0
    x[..., 3] *= 40.0  # an outlier channel, as real activations have
    if nonnegative:
        x = np.abs(x)
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("act_format", ["int4", "uint4", "fp8"])
@pytest.mark.parametrize("rank", [0, 16])
def test_act_quant_matches_numpy(rng, dtype, act_format, rank):
    np_dtype = HALF[dtype]
    m, k = 6, 256
    x = _random_x(rng, (2, m // 2, k), np_dtype, nonnegative=act_format == "uint4")
    smooth = rng.uniform(0.5, 2.0, k).astype(np.float32)
    lora_down = (rng.standard_normal((k, rank)) * 0.1).astype(np_dtype)
    q, s, la = jax.jit(reference.act_quant, static_argnames="act_format")(
        x, smooth, lora_down, act_format=act_format
    )
    x_hat = x.astype(np.float32) / smooth
    if act_format == "fp8":
        values, scales = spec.quantize_fp8(x_hat)
    else:
        values, scales = spec.quantize_int4(x_hat, np_dtype, unsigned=act_format == "uint4")
    assert q.shape == x.shape and q.dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(q), spec.e4m3_codes(values))
    np.testing.assert_array_equal(np.asarray(s, np.float32), scales)
    la64 = x.astype(np.float64) @ lora_down.astype(np.float64)
    np.testing.assert_allclose(np.asarray(la), la64, rtol=1e-5, atol=1e-5 * np.abs(la64).max(initial=1))


def _random_w4a4_operands(rng, lead, n, k, r, act_format, np_dtype):
    x_group = 128 if act_format == "fp8" else 64
    if act_format == "fp8":
        x_values = rng.uniform(-448, 448, (*lead, k)).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        s_x = rng.uniform(1e-3, 1e-2, (*lead, k // x_group)).astype(np.float32)
    else:
        lo, hi = (0, 16) if act_format == "uint4" else (-8, 8)
        x_values = rng.integers(lo, hi, (*lead, k)).astype(np.float64)
        s_x = rng.uniform(0.01, 0.1, (*lead, k // x_group)).astype(np_dtype)
    q_x = spec.e4m3_codes(x_values)
    q_w = rng.integers(-8, 8, (n, k))
    s_w = rng.uniform(0.005, 0.02, (n, k // 64)).astype(np_dtype)
    la = rng.standard_normal((*lead, r)).astype(np.float32)
    lora_up = (rng.standard_normal((r, n)) * 0.1).astype(np_dtype)
    return x_values, q_x, s_x, x_group, q_w, s_w, la, lora_up


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("act_format", ["int4", "uint4", "fp8"])
@pytest.mark.parametrize("rank,affine", [(0, False), (32, True), (16, False)])
def test_w4a4_gemm_matches_numpy(rng, dtype, act_format, rank, affine):
    np_dtype = HALF[dtype]
    lead, n, k = (3, 5), 48, 384
    x_values, q_x, s_x, x_group, q_w, s_w, la, lora_up = _random_w4a4_operands(
        rng, lead, n, k, rank, act_format, np_dtype
    )
    alpha = rng.uniform(0.5, 1.5, n).astype(np.float32) if affine else None
    bias = rng.standard_normal(n).astype(np_dtype) if affine else None
    y = jax.jit(reference.w4a4_gemm, static_argnames="act_format")(
        q_x, s_x, la, spec.pack_nibbles(q_w), s_w, lora_up, alpha, bias, act_format=act_format
    )
    assert y.dtype == np_dtype and y.shape == (*lead, n)
    y64 = spec.w4a4_gemm(x_values, s_x, x_group, q_w, s_w, la, lora_up, np_dtype, alpha, bias)
    spec.assert_close_to_rounded(np.asarray(y), y64, np_dtype)


def test_w4a4_gemm_tolerance_can_fail(rng):
    """The comparison above catches a single wrong group scale."""
    np_dtype = ml_dtypes.bfloat16
    x_values, q_x, s_x, x_group, q_w, s_w, la, lora_up = _random_w4a4_operands(
        rng, (4,), 32, 256, 16, "int4", np_dtype
    )
    y = reference.w4a4_gemm(q_x, s_x, la, spec.pack_nibbles(q_w), s_w, lora_up, act_format="int4")
    s_w_wrong = s_w.copy()
    s_w_wrong[5, 2] = s_w_wrong[5, 2] * 1.25
    y64 = spec.w4a4_gemm(x_values, s_x, x_group, q_w, s_w_wrong, la, lora_up, np_dtype)
    with pytest.raises(AssertionError):
        spec.assert_close_to_rounded(np.asarray(y), y64, np_dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
def test_w4a16_gemm_matches_numpy(rng, dtype, group_size, zero_point, act_order):
    np_dtype = HALF[dtype]
    n, k = 40, 256  # group_size 256 == K is per-channel
    groups = k // group_size
    q = rng.integers(0, 16, (n, k))
    scales = rng.uniform(0.005, 0.02, (n, groups)).astype(np_dtype)
    zeros = rng.integers(0, 16, (n, groups)).astype(np.uint8) if zero_point else None
    g_idx = np.arange(k) // group_size
    if act_order:
        g_idx = rng.permutation(g_idx)
    x = _random_x(rng, (2, 3, k), np_dtype)
    bias = rng.standard_normal(n).astype(np_dtype)
    y = jax.jit(reference.w4a16_gemm, static_argnames="group_size")(
        x, spec.pack_nibbles(q), scales, zeros, g_idx.astype(np.int32) if act_order else None, bias,
        group_size=group_size,
    )
    w_hat = spec.w4a16_dequantize(q, scales, zeros, g_idx)
    y64 = x.astype(np.float64) @ w_hat.T + bias.astype(np.float64)
    spec.assert_close_to_rounded(np.asarray(y), y64, np_dtype)
