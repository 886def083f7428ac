"""AutoGPTQ / AutoAWQ checkpoint import: a numpy packer written from the documented layouts, then
pack -> import -> unprepack / dequantize / linear against the original q, z, s."""

import jax.numpy as jnp
import numpy as np
import pytest

import jax_w4a4
from jax_w4a4.formats import w4a16_layout
from jax_w4a4.quantize import from_awq, from_gptq

N, K, M = 64, 256, 8
AWQ_INTERLEAVE = [0, 2, 4, 6, 1, 3, 5, 7]


def _words(nibbles: np.ndarray) -> np.ndarray:
    """(..., 8) values 0..15 -> int32 (...), element i in bits 4i..4i+3."""
    word = np.zeros(nibbles.shape[:-1], np.uint32)
    for i in range(8):
        word |= nibbles[..., i].astype(np.uint32) << np.uint32(4 * i)
    return word.view(np.int32)


def pack_gptq(q_nk, stored_zeros_ng, scales_ng):
    """AutoGPTQ: qweight (K/8, N) packed along K; qzeros (G, N/8) packed along N; scales (G, N)."""
    q_kn = q_nk.T
    qweight = _words(q_kn.reshape(K // 8, 8, N).transpose(0, 2, 1))
    qzeros = _words(stored_zeros_ng.T.reshape(-1, N // 8, 8))
    return qweight, qzeros, scales_ng.T


def pack_awq(q_nk, zeros_ng, scales_ng):
    """AutoAWQ GEMM: (K, N/8) / (G, N/8) packed along N, slot j holding column 8c + order[j]."""
    def pack_columns(a_rows_by_n):
        rows = a_rows_by_n.shape[0]
        return _words(a_rows_by_n.reshape(rows, N // 8, 8)[..., AWQ_INTERLEAVE])
    return pack_columns(q_nk.T), pack_columns(zeros_ng.T), scales_ng.T


def _groups_of(group_size, act_order, rng):
    g = K if group_size == -1 else group_size
    contiguous = np.arange(K) // g
    if not act_order:
        return g, contiguous
    g_idx = np.empty(K, np.int32)
    g_idx[rng.permutation(K)] = contiguous  # GPTQ act-order: every group still holds g rows
    return g, g_idx


def _random_layer(rng, group_size, act_order, z_low, z_high, dtype):
    g, g_idx = _groups_of(group_size, act_order, rng)
    groups = K // g
    q = rng.integers(0, 16, (N, K), dtype=np.uint8)
    z = rng.integers(z_low, z_high + 1, (N, groups), dtype=np.uint8)
    s = np.asarray(jnp.asarray(rng.uniform(0.005, 0.05, (N, groups)), dtype).astype(jnp.float32))
    bias = np.asarray(jnp.asarray(rng.normal(size=N), dtype).astype(jnp.float32))
    w_hat = (q.astype(np.float64) - z[:, g_idx]) * s[:, g_idx].astype(np.float64)
    return q, z, s, g_idx.astype(np.int32), bias, w_hat


def _check_imported(weights, q, z, w_hat, bias, rng, dtype, expect_g_idx):
    logical = np.asarray(w4a16_layout.unprepack(weights.qweight, N, K))
    np.testing.assert_array_equal(logical, q[:, 0::2] | (q[:, 1::2] << 4))
    if z is None:
        assert weights.zeros is None
    else:
        assert weights.zeros.dtype == jnp.uint8
        np.testing.assert_array_equal(np.asarray(weights.zeros), z.T)  # the kernel layout (G, N)
    assert (weights.g_idx is not None) == expect_g_idx
    if expect_g_idx:  # the kernel reads K in the stable argsort(g_idx) order stored with qweight
        np.testing.assert_array_equal(
            np.asarray(w4a16_layout.permutation(weights.qweight, K)),
            np.argsort(np.asarray(weights.g_idx), kind="stable"),
        )
    assert weights.scales.dtype == dtype and weights.bias.dtype == dtype
    np.testing.assert_array_equal(np.asarray(weights.dequantize(), np.float64), w_hat)  # (q − z)·s is exact in fp32

    x = jnp.asarray(rng.normal(size=(M, K)), dtype)
    ref = np.asarray(x, np.float64) @ w_hat.T + bias
    out = np.asarray(jax_w4a4.linear(x, weights), np.float64)
    tol = 1e-2 * np.abs(ref).max()  # half-precision output and accumulation; |ref| ~ 1
    np.testing.assert_allclose(out, ref, rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("fmt,sym", [("gptq", True), ("gptq", False), ("gptq_v2", True), ("gptq_v2", False)])
def test_gptq_import_is_exact(rng, fmt, sym, act_order, dtype):
    group_size = 32 if act_order else (128 if sym else -1)
    z_low, z_high = (8, 8) if sym else ((1, 15) if fmt == "gptq" else (0, 15))
    q, z, s, g_idx, bias, w_hat = _random_layer(rng, group_size, act_order, z_low, z_high, dtype)
    stored = z - 1 if fmt == "gptq" else z
    qweight, qzeros, scales = pack_gptq(q, stored, s)
    weights = from_gptq(
        qweight, qzeros, scales.astype(np.float16 if dtype == jnp.float16 else np.float32),
        g_idx=g_idx, bias=bias, group_size=group_size, sym=sym, checkpoint_format=fmt, dtype=dtype,
    )
    assert weights.group_size == (K if group_size == -1 else group_size)
    _check_imported(weights, q, None if sym else z, w_hat, bias, rng, dtype, expect_g_idx=act_order)


def test_gptq_keeps_zeros_unless_sym_and_all_eight(rng):
    q, z, s, g_idx, _, _ = _random_layer(rng, 128, False, 0, 15, jnp.float16)
    z[0, 0] = 3  # at least one z != 8
    packed = pack_gptq(q, z, s)
    kept = from_gptq(*packed, g_idx=g_idx, group_size=128, sym=True, checkpoint_format="gptq_v2")
    np.testing.assert_array_equal(np.asarray(kept.zeros), z.T)
    eights = np.full_like(z, 8)
    packed = pack_gptq(q, eights, s)
    asym = from_gptq(*packed, group_size=128, sym=False, checkpoint_format="gptq_v2")
    np.testing.assert_array_equal(np.asarray(asym.zeros), eights.T)
    assert from_gptq(*packed, group_size=128, sym=True, checkpoint_format="gptq_v2").zeros is None


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_awq_import_is_exact(rng, group_size, dtype):
    q, z, s, _, bias, w_hat = _random_layer(rng, group_size, False, 0, 15, dtype)
    qweight, qzeros, scales = pack_awq(q, z, s)
    weights = from_awq(qweight, qzeros, scales, bias=bias, group_size=group_size, dtype=dtype)
    _check_imported(weights, q, z, w_hat, bias, rng, dtype, expect_g_idx=False)


def test_awq_interleave_is_not_the_identity(rng):
    """A column-ordered (GPTQ-style) qzeros word read as AWQ lands on the wrong columns."""
    z = np.tile(np.arange(8, dtype=np.uint8), (N // 8, K // 128)).reshape(N, K // 128)
    q = rng.integers(0, 16, (N, K), dtype=np.uint8)
    s = np.ones((N, K // 128), np.float32)
    _, qzeros_plain, _ = pack_gptq(q, z, s)
    qweight, qzeros, scales = pack_awq(q, z, s)
    assert not np.array_equal(qzeros, qzeros_plain)
    np.testing.assert_array_equal(np.asarray(from_awq(qweight, qzeros, scales, group_size=128).zeros), z.T)


def test_validation_names_the_argument(rng):
    q, z, s, g_idx, _, _ = _random_layer(rng, 128, False, 1, 15, jnp.float16)
    qweight, qzeros, scales = pack_gptq(q, z - 1, s)
    cases = [
        ({"qweight": qweight.view(np.uint32)}, "qweight must be int32"),
        ({"qzeros": qzeros[:1]}, "qzeros must have shape"),
        ({"scales": scales[:, :8]}, "scales must have shape"),
        ({"g_idx": g_idx[:8]}, "g_idx must be an integer array"),
        ({"bias": np.zeros(3, np.float32)}, "bias must have shape"),
        ({"checkpoint_format": "awq"}, "checkpoint_format must be one of"),
        ({"group_size": 96}, "group_size"),
        ({"dtype": jnp.float32}, "dtype must be one of"),
        ({"g_idx": np.zeros(K, np.int32)}, "g_idx"),  # not act-order: group 0 holds all K rows
    ]
    base = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "group_size": 128, "sym": False}
    for override, message in cases:
        with pytest.raises(ValueError, match=message):
            from_gptq(**{**base, **override})
    stored_15 = z.copy()
    stored_15[0, 0] = 15
    with pytest.raises(ValueError, match="qzeros: a gptq \\(v1\\) zero nibble of 15"):
        from_gptq(*pack_gptq(q, stored_15, s), group_size=128, sym=False)
    qweight_awq, qzeros_awq, _ = pack_awq(q, z, s)
    with pytest.raises(ValueError, match="qzeros must have shape"):
        from_awq(qweight_awq, qzeros_awq[:, :2], scales, group_size=128)
    with pytest.raises(ValueError, match="qweight must be int32"):
        from_awq(qweight_awq[0], qzeros_awq, scales, group_size=128)
