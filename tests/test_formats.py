"""jax_w4a4.formats against independent NumPy implementations of docs/layouts.md (CPU, fast).

Every quantizer is run under jax.jit (where XLA's simplifications apply) and compared bit for bit
with a NumPy reference that follows the contract literally: fp32 IEEE divisions, scales rounded to
their storage dtype before use, round half to even. Dequantized values are checked in float64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_w4a4 import formats
from jax_w4a4.formats import fp4, fp8, svdq, w4a16
from jax_w4a4.formats.int4 import pack_int4, quantize_int4_groups, unpack_int4

SCALE_DTYPES = [jnp.bfloat16, jnp.float16]
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
F32 = np.float32


def jit(fn, **static):
    """``fn`` under jax.jit with keyword arguments bound (Python ints/bools/dtypes stay static)."""
    return jax.jit(functools.partial(fn, **static))


def random_groups(rng: np.random.Generator, shape: tuple[int, ...], group: int) -> np.ndarray:
    """Normal data whose groups along the last axis span several orders of magnitude (fp32)."""
    x = rng.standard_normal(shape)
    magnitude = 10.0 ** rng.uniform(-2, 2, (*shape[:-1], shape[-1] // group, 1))
    return (x.reshape(*shape[:-1], -1, group) * magnitude).reshape(shape).astype(F32)


# ----------------------------------------------------------------------------------------------------
# NumPy references


def ref_pack(q: np.ndarray) -> np.ndarray:
    nib = np.asarray(q).astype(np.int64) & 0xF
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)


def ref_unpack(packed: np.ndarray, signed: bool) -> np.ndarray:
    p = np.asarray(packed).astype(np.int64)
    out = np.empty((*p.shape[:-1], 2 * p.shape[-1]), np.int64)
    out[..., 0::2], out[..., 1::2] = p & 0xF, p >> 4
    return np.where(out >= 8, out - 16, out) if signed else out


def ref_int4_groups(x, group, scale_dtype, unsigned=False):
    """(q int64 (..., K), scales (..., K/G) in scale_dtype)."""
    xg = np.asarray(x, F32).reshape(*np.shape(x)[:-1], -1, group)
    lo, hi = (0, 15) if unsigned else (-8, 7)
    scales = (np.abs(xg).max(-1) / F32(hi)).astype(scale_dtype)
    s32 = scales.astype(F32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s32 == 0, 0, np.clip(np.round(xg / s32), lo, hi))
    return q.reshape(np.shape(x)).astype(np.int64), scales


def ref_w4a16(w, group_size, zero_point, scale_dtype):
    """(q int64 (N, K), scales (N, G), zeros int64 (N, G)) by reshaping into contiguous groups."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    wg = np.asarray(w, F32).reshape(n, k // g, g)
    wmin, wmax = np.minimum(wg.min(-1), F32(0)), np.maximum(wg.max(-1), F32(0))
    with np.errstate(divide="ignore", invalid="ignore"):
        if zero_point:
            scales = ((wmax - wmin) / F32(15)).astype(scale_dtype)
            s32 = scales.astype(F32)
            zeros = np.where(s32 == 0, 0, np.clip(np.round(-wmin / s32), 0, 15))
        else:
            scales = ((F32(2) * np.maximum(wmax, -wmin)) / F32(15)).astype(scale_dtype)
            s32 = scales.astype(F32)
            zeros = np.full(s32.shape, 8.0)
        q = np.where(
            s32[..., None] == 0,
            zeros[..., None],
            np.clip(np.round(wg / s32[..., None]) + zeros[..., None], 0, 15),
        )
    return q.reshape(n, k).astype(np.int64), scales, zeros.astype(np.int64)


def ref_encode_e2m1(x) -> np.ndarray:
    """Nearest e2m1 grid point, ties to the even index (= even mantissa), saturating; sign kept."""
    x = np.asarray(x, np.float64)
    dist = np.abs(np.abs(x)[..., None] - E2M1_GRID)
    idx = dist.argmin(-1)  # the lower index on a tie
    upper = np.minimum(idx + 1, 7)
    tie = np.take_along_axis(dist, upper[..., None], -1)[..., 0] == dist.min(-1)
    idx = np.where(tie & (idx % 2 == 1) & (upper != idx), upper, idx)
    return (idx | (np.signbit(x) << 3)).astype(np.int64)


def ref_decode_e2m1(codes) -> np.ndarray:
    codes = np.asarray(codes).astype(np.int64)
    return np.where(codes & 8, -1.0, 1.0) * E2M1_GRID[codes & 7]


def e2m1_error_bound(y: np.ndarray) -> np.ndarray:
    """Largest |y − e2m1(y)| for a scaled value y: half the grid gap, or the saturation excess."""
    a = np.abs(y)
    half_gap = np.where(a <= 2, 0.25, np.where(a <= 4, 0.5, 1.0))
    return np.maximum(half_gap, a - 6.0)


def e4m3_bits(x_f32: np.ndarray) -> np.ndarray:
    return np.asarray(x_f32, F32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e4m3_value(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)


# ----------------------------------------------------------------------------------------------------
# 4-bit packing


def test_pack_nibble_order_known_bytes():
    for dtype in (np.int8, np.int32):
        packed = jit(pack_int4)(np.array([[1, -1, -8, 7, 0, -1]], dtype))
        np.testing.assert_array_equal(np.asarray(packed), [[0xF1, 0x78, 0xF0]])
    packed = jit(pack_int4)(np.array([[1, 15, 8, 7, 0, 15]], np.uint8))
    np.testing.assert_array_equal(np.asarray(packed), [[0xF1, 0x78, 0xF0]])


def test_unpack_every_byte_and_repack():
    every_byte = np.arange(256, dtype=np.uint8).reshape(16, 16)
    for signed in (False, True):
        values = np.asarray(jit(unpack_int4, signed=signed)(every_byte))
        assert values.dtype == np.int8 and values.shape == (16, 32)
        np.testing.assert_array_equal(values, ref_unpack(every_byte, signed))
        np.testing.assert_array_equal(np.asarray(jit(pack_int4)(values)), every_byte)


@pytest.mark.parametrize(
    "dtype,lo,hi,signed",
    [(np.int8, -8, 7, True), (np.uint8, 0, 15, False), (np.int32, -8, 7, True), (np.int32, 0, 15, False)],
)
def test_pack_unpack_random_round_trip(dtype, lo, hi, signed):
    rng = np.random.default_rng(1)
    q = rng.integers(lo, hi + 1, size=(3, 5, 40)).astype(dtype)
    q[0, 0, :4] = [lo, hi, 0, hi]  # edge values
    packed = np.asarray(jit(pack_int4)(q))
    assert packed.dtype == np.uint8 and packed.shape == (3, 5, 20)
    np.testing.assert_array_equal(packed, ref_pack(q))
    np.testing.assert_array_equal(np.asarray(jit(unpack_int4, signed=signed)(packed)), q)


def test_packing_rejects_bad_input():
    with pytest.raises(ValueError, match="q: the last dimension must be even"):
        pack_int4(np.zeros((2, 3), np.int8))
    with pytest.raises(ValueError, match="q must have an integer dtype"):
        pack_int4(np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="packed must have dtype uint8"):
        unpack_int4(np.zeros((2, 4), np.int8), signed=True)


# ----------------------------------------------------------------------------------------------------
# group int4 quantization and svdq


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("unsigned", [False, True])
@pytest.mark.parametrize("group", [32, 64])
def test_int4_groups_match_reference(scale_dtype, unsigned, group):
    rng = np.random.default_rng(2)
    x = random_groups(rng, (2, 16, 256), group)
    if unsigned:
        x = np.abs(x)
    q, scales = jit(quantize_int4_groups, group_size=group, scale_dtype=scale_dtype, unsigned=unsigned)(x)
    q_ref, s_ref = ref_int4_groups(x, group, scale_dtype, unsigned)
    assert q.dtype == jnp.int8 and q.shape == x.shape
    assert scales.dtype == scale_dtype and scales.shape == (2, 16, 256 // group)
    np.testing.assert_array_equal(np.asarray(scales).view(np.uint16), s_ref.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(q), q_ref)
    # The stored scale is absmax/q_max rounded once to the storage dtype (within half an ulp of it).
    exact = np.abs(x.astype(np.float64)).reshape(2, 16, -1, group).max(-1) / (15 if unsigned else 7)
    ulp = np.spacing(np.asarray(scales).astype(F32)).astype(np.float64) * 2.0 ** (
        23 - ml_dtypes.finfo(scale_dtype).nmant
    )
    assert np.all(np.abs(np.asarray(scales).astype(np.float64) - exact) <= ulp / 2)
    # Inside the range every element is within half a step of its dequantized value.
    s = np.repeat(np.asarray(scales).astype(np.float64), group, axis=-1)
    err = np.abs(x - np.asarray(q).astype(np.float64) * s)
    assert np.all(err <= s / 2 * (1 + 1e-6))


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_int4_round_half_to_even(scale_dtype):
    rng = np.random.default_rng(3)
    s = 0.25  # exact in bf16 and fp16; absmax = 7·s makes it the stored scale
    ties = np.array([7, 2.5, 3.5, -2.5, -3.5, 0.5, 1.5, -0.5, -7]) * s
    x = np.concatenate([ties, rng.uniform(-6.9 * s, 6.9 * s, 64 - ties.size)]).astype(F32)[None]
    q, scales = jit(quantize_int4_groups, group_size=64, scale_dtype=scale_dtype)(x)
    assert float(scales[0, 0]) == s
    np.testing.assert_array_equal(np.asarray(q)[0, : ties.size], [7, 2, 4, -2, -4, 0, 2, 0, -7])


def test_unsigned_negative_inputs_saturate_to_zero():
    rng = np.random.default_rng(4)
    x = np.abs(rng.standard_normal((3, 64))).astype(F32)
    x[:, ::5] *= -1
    q, _ = jit(quantize_int4_groups, group_size=64, scale_dtype=jnp.bfloat16, unsigned=True)(x)
    q = np.asarray(q)
    assert np.all(q[:, ::5] == 0) and q.min() == 0 and q.max() == 15


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_svdq_weights_and_activations(scale_dtype):
    rng = np.random.default_rng(5)
    w = random_groups(rng, (48, 512), 64)
    qweight, wscales = jit(svdq.quantize_weights, scale_dtype=scale_dtype)(w)
    q_ref, s_ref = ref_int4_groups(w, 64, scale_dtype)
    assert qweight.dtype == jnp.uint8 and qweight.shape == (48, 256) and wscales.shape == (48, 8)
    np.testing.assert_array_equal(np.asarray(qweight), ref_pack(q_ref))
    np.testing.assert_array_equal(np.asarray(wscales).view(np.uint16), s_ref.view(np.uint16))
    deq = np.asarray(jit(svdq.dequantize, signed=True)(qweight, wscales))
    expected = q_ref * np.repeat(s_ref.astype(np.float64), 64, axis=-1)
    np.testing.assert_array_equal(deq, expected)

    for unsigned in (False, True):
        x = random_groups(rng, (2, 3, 256), 64)
        x = np.abs(x) if unsigned else x
        q, scales = jit(svdq.quantize_activations, scale_dtype=scale_dtype, unsigned=unsigned)(x)
        q_ref, s_ref = ref_int4_groups(x, 64, scale_dtype, unsigned)
        assert q.shape == (2, 3, 128) and scales.shape == (2, 3, 4)
        np.testing.assert_array_equal(np.asarray(q), ref_pack(q_ref))
        np.testing.assert_array_equal(np.asarray(scales).view(np.uint16), s_ref.view(np.uint16))
        deq = np.asarray(jit(svdq.dequantize, signed=not unsigned)(q, scales))
        np.testing.assert_array_equal(deq, q_ref * np.repeat(s_ref.astype(np.float64), 64, axis=-1))


@pytest.mark.parametrize("unsigned", [False, True])
def test_svdq_zero_and_underflowing_groups(unsigned):
    rng = np.random.default_rng(6)
    x = np.abs(rng.standard_normal((2, 192))).astype(F32)
    x[0, :64] = 0.0  # all-zero group
    x[1, 64:128] = rng.uniform(0, 1e-9, 64)  # absmax/q_max underflows to 0 in fp16
    q, scales = jit(svdq.quantize_activations, scale_dtype=jnp.float16, unsigned=unsigned)(x)
    values = np.asarray(jit(unpack_int4, signed=not unsigned)(q))
    assert float(scales[0, 0]) == 0 and float(scales[1, 1]) == 0
    assert np.all(values[0, :64] == 0) and np.all(values[1, 64:128] == 0)
    deq = np.asarray(jit(svdq.dequantize, signed=not unsigned)(q, scales))
    assert np.all(np.isfinite(deq)) and np.all(deq[0, :64] == 0) and np.all(deq[1, 64:128] == 0)


# ----------------------------------------------------------------------------------------------------
# w4a16


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_w4a16_matches_reference(group_size, zero_point, scale_dtype):
    rng = np.random.default_rng(7)
    w = random_groups(rng, (24, 256), 32)
    w[:, :32] += 0.5 * np.abs(w[:, :32])  # skewed groups exercise the zero points
    out = jit(w4a16.quantize, group_size=group_size, zero_point=zero_point, scale_dtype=scale_dtype)(w)
    q_ref, s_ref, z_ref = ref_w4a16(w, group_size, zero_point, scale_dtype)
    groups = w4a16.n_groups(256, group_size)
    assert out.qweight.dtype == jnp.uint8 and out.qweight.shape == (24, 128)
    assert out.scales.dtype == scale_dtype and out.scales.shape == (24, groups)
    np.testing.assert_array_equal(np.asarray(out.qweight), ref_pack(q_ref))
    np.testing.assert_array_equal(np.asarray(out.scales).view(np.uint16), s_ref.view(np.uint16))
    if zero_point:
        assert out.zeros.dtype == jnp.uint8 and out.zeros.shape == (24, groups)
        np.testing.assert_array_equal(np.asarray(out.zeros), z_ref)
    else:
        assert out.zeros is None

    deq = np.asarray(jit(w4a16.dequantize, group_size=group_size)(*out))
    g = 256 if group_size == -1 else group_size
    s = np.repeat(s_ref.astype(np.float64), g, axis=-1)
    z = np.repeat(z_ref, g, axis=-1)
    np.testing.assert_array_equal(deq, (q_ref - z) * s)
    with np.errstate(divide="ignore", invalid="ignore"):
        unclipped_q = np.round(w.astype(F32) / s.astype(F32)) + z
    inside = (unclipped_q >= 0) & (unclipped_q <= 15)
    assert inside.mean() > 0.9
    assert np.all(np.abs(w - deq)[inside] <= (s / 2 * (1 + 1e-6))[inside])
    if group_size == -1:  # group_size == K names the same per-channel layout
        np.testing.assert_array_equal(np.asarray(jit(w4a16.dequantize, group_size=256)(*out)), deq)


def test_w4a16_round_half_to_even_and_clipping():
    rng = np.random.default_rng(8)
    s = 0.25  # 2·absmax/15 with absmax = 7.5·s
    ties = np.array([7.5, -7.5, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5]) * s
    w = np.concatenate([ties, rng.uniform(-7 * s, 7 * s, 32 - ties.size)]).astype(F32)[None]
    out = jit(w4a16.quantize, group_size=32, zero_point=False, scale_dtype=jnp.bfloat16)(w)
    assert float(out.scales[0, 0]) == s
    q = ref_unpack(np.asarray(out.qweight), signed=False)[0, : ties.size]
    np.testing.assert_array_equal(q, [15, 0, 10, 12, 6, 4, 8, 8])


@pytest.mark.parametrize("zero_point", [False, True])
def test_w4a16_zero_group(zero_point):
    rng = np.random.default_rng(9)
    w = rng.standard_normal((2, 64)).astype(F32)
    w[1, 32:] = 0.0
    out = jit(w4a16.quantize, group_size=32, zero_point=zero_point, scale_dtype=jnp.float16)(w)
    assert float(out.scales[1, 1]) == 0
    q = ref_unpack(np.asarray(out.qweight), signed=False)
    assert np.all(q[1, 32:] == (0 if zero_point else 8))  # q = z; a zero group's zero point is 0
    deq = np.asarray(jit(w4a16.dequantize, group_size=32)(*out))
    assert np.all(np.isfinite(deq)) and np.all(deq[1, 32:] == 0)


@pytest.mark.parametrize("zero_point", [False, True])
def test_w4a16_act_order_equals_permuted_problem(zero_point):
    rng = np.random.default_rng(10)
    n, k, g = 16, 256, 64
    w = random_groups(rng, (n, k), k)
    perm = rng.permutation(k)  # act order: the j-th column processed is perm[j], in group j // g
    g_idx = (np.argsort(perm) // g).astype(np.int32)
    quant = jit(w4a16.quantize, group_size=g, zero_point=zero_point, scale_dtype=jnp.bfloat16)
    act = quant(w, g_idx=g_idx)
    permuted = quant(w[:, perm])
    np.testing.assert_array_equal(np.asarray(act.scales), np.asarray(permuted.scales))
    if zero_point:
        np.testing.assert_array_equal(np.asarray(act.zeros), np.asarray(permuted.zeros))
    q_act = ref_unpack(np.asarray(act.qweight), signed=False)
    np.testing.assert_array_equal(q_act[:, perm], ref_unpack(np.asarray(permuted.qweight), signed=False))
    deq_act = np.asarray(jit(w4a16.dequantize, group_size=g)(*act, g_idx=g_idx))
    deq_permuted = np.asarray(jit(w4a16.dequantize, group_size=g)(*permuted))
    np.testing.assert_array_equal(deq_act[:, perm], deq_permuted)


@pytest.mark.parametrize("zero_point", [False, True])
def test_w4a16_arbitrary_g_idx_with_an_empty_group(zero_point):
    """Groups of unequal sizes, one of them empty: scales from the numpy group extremes, empty -> 0."""
    rng = np.random.default_rng(11)
    n, k, g, groups = 8, 256, 64, 4
    w = rng.standard_normal((n, k)).astype(F32)
    g_idx = rng.choice([0, 1, 3], size=k).astype(np.int32)  # group 2 is empty
    out = jit(w4a16.quantize, group_size=g, zero_point=zero_point, scale_dtype=jnp.float16)
    scales = np.asarray(out(w, g_idx=g_idx).scales).astype(F32)
    for j in range(groups):
        cols = w[:, g_idx == j]
        lo = np.minimum(cols.min(axis=1), 0) if cols.size else np.zeros(n, F32)
        hi = np.maximum(cols.max(axis=1), 0) if cols.size else np.zeros(n, F32)
        expected = (hi - lo) / 15 if zero_point else 2 * np.maximum(hi, -lo) / 15
        np.testing.assert_array_equal(scales[:, j], expected.astype(np.float16).astype(F32), err_msg=f"group {j}")


def test_w4a16_rejects_bad_arguments():
    w = np.ones((4, 256), F32)
    with pytest.raises(ValueError, match="group_size must be one of"):
        w4a16.quantize(w, group_size=16, zero_point=False, scale_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of group_size=128"):
        w4a16.n_groups(192, 128)
    with pytest.raises(ValueError, match="scale_dtype must be bfloat16 or float16"):
        w4a16.quantize(w, group_size=64, zero_point=False, scale_dtype=jnp.float32)
    with pytest.raises(ValueError, match="g_idx must be an integer array of shape"):
        w4a16.quantize(
            w, group_size=64, zero_point=False, scale_dtype=jnp.bfloat16, g_idx=np.zeros(64, np.int32)
        )
    quant = functools.partial(w4a16.quantize, group_size=64, zero_point=True, scale_dtype=jnp.bfloat16)
    out = jax.eval_shape(quant, w)
    with pytest.raises(ValueError, match="scales must have shape"):
        jax.eval_shape(functools.partial(w4a16.dequantize, group_size=32), *out)
    assert w4a16.n_groups(256, -1) == 1 and w4a16.n_groups(256, 32) == 8


def test_scale_dtype_and_group_divisibility_errors():
    with pytest.raises(ValueError, match="scale_dtype must be bfloat16 or float16"):
        svdq.quantize_weights(np.ones((4, 128), F32), scale_dtype=jnp.float32)
    with pytest.raises(ValueError, match="multiple of the group size 64"):
        svdq.quantize_weights(np.ones((4, 96), F32), scale_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="w must be 2-D"):
        svdq.quantize_weights(np.ones((128,), F32), scale_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of the group size 128"):
        fp8.quantize_activations(np.ones((4, 64), F32))
    with pytest.raises(ValueError, match="multiple of the group size 16"):
        fp4.quantize_nvfp4(np.ones((4, 24), F32))
    with pytest.raises(ValueError, match="multiple of the group size 32"):
        fp4.quantize_mxfp4(np.ones((4, 48), F32))
    with pytest.raises(ValueError, match="scales must have shape"):
        svdq.dequantize(np.zeros((4, 64), np.uint8), np.ones((4, 3), jnp.bfloat16), signed=True)


# ----------------------------------------------------------------------------------------------------
# fp8 (w4a8 activations)


def test_fp8_matches_reference():
    rng = np.random.default_rng(11)
    x = random_groups(rng, (3, 8, 512), 128)
    x[0, 0, :128] = 0.0  # zero group
    q, scales = jit(fp8.quantize_activations)(x)
    xg = x.reshape(3, 8, 4, 128)
    s_ref = np.abs(xg).max(-1) / F32(448)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(s_ref[..., None] == 0, F32(0), xg / s_ref[..., None])
    q_ref = e4m3_bits(np.clip(y, -448, 448)).reshape(x.shape)
    assert q.dtype == jnp.uint8 and q.shape == x.shape and scales.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(scales), s_ref)
    np.testing.assert_array_equal(np.asarray(q), q_ref)
    assert float(scales[0, 0, 0]) == 0 and np.all(np.asarray(q)[0, 0, :128] == 0)
    # No NaN pattern; the absmax element of every nonzero group saturates exactly to ±448.
    codes = np.asarray(q).reshape(3, 8, 4, 128)
    assert not np.any((codes & 0x7F) == 0x7F)
    at_absmax = np.take_along_axis(codes, np.abs(xg).argmax(-1)[..., None], -1)[..., 0]
    assert np.all((at_absmax & 0x7F)[s_ref > 0] == 0x7E)

    deq = np.asarray(jit(fp8.dequantize)(q, scales))
    deq_ref = (e4m3_value(q_ref).reshape(xg.shape) * s_ref[..., None]).reshape(x.shape)
    np.testing.assert_array_equal(deq, deq_ref)
    s = np.repeat(s_ref.astype(np.float64), 128, axis=-1).reshape(x.shape)
    bound = np.maximum(np.abs(x) * 2.0**-4, s * 2.0**-10) * (1 + 1e-5)  # 3 mantissa bits; subnormal step
    assert np.all(np.abs(x - deq) <= bound)


def test_fp8_bit_conversion_saturates_and_rounds_half_to_even():
    x = np.array([448.0, 460.0, 1e6, -1e30, 0.0, 1.0 + 1 / 16, 1.0 + 3 / 16, 2.0**-10], F32)
    bits = np.asarray(jax.jit(fp8.to_e4m3_bits)(x))
    np.testing.assert_array_equal(e4m3_value(bits), [448, 448, 448, -448, 0, 1.0, 1.25, 0])


# ----------------------------------------------------------------------------------------------------
# e2m1, nvfp4, mxfp4


def test_e2m1_every_code_decodes():
    codes = np.arange(16, dtype=np.uint8)
    values = np.asarray(jit(fp4.decode_e2m1)(codes))
    np.testing.assert_array_equal(values, np.concatenate([E2M1_GRID, -E2M1_GRID]))
    assert np.all(np.signbit(values[8:]))
    np.testing.assert_array_equal(np.asarray(jit(fp4.encode_e2m1)(values)), codes)


def test_e2m1_midpoints_round_to_even_and_saturate():
    midpoints = (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2  # 0.25 0.75 1.25 1.75 2.5 3.5 5
    expected = np.array([0, 2, 2, 4, 4, 6, 6])  # ties go to the even index (even mantissa)
    encode = jit(fp4.encode_e2m1)
    np.testing.assert_array_equal(np.asarray(encode(midpoints.astype(F32))), expected)
    np.testing.assert_array_equal(np.asarray(encode(-midpoints.astype(F32))), expected | 8)
    big = np.array([6.0, 6.5, 7.0, 1e30, np.inf, -7.0, -np.inf], F32)
    np.testing.assert_array_equal(np.asarray(encode(big)), [7, 7, 7, 7, 7, 15, 15])


def test_e2m1_random_matches_references():
    rng = np.random.default_rng(12)
    mid = (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2
    near = np.concatenate([np.nextafter(mid.astype(F32), 0), np.nextafter(mid.astype(F32), 10)])
    x = np.concatenate([rng.uniform(-8, 8, 4000), near, -near]).astype(F32)
    codes = np.asarray(jit(fp4.encode_e2m1)(x))
    np.testing.assert_array_equal(codes, ref_encode_e2m1(x))
    np.testing.assert_array_equal(np.asarray(jit(fp4.decode_e2m1)(codes)), ref_decode_e2m1(codes))
    inside = np.abs(x) <= 6  # ml_dtypes' RNE cast as a second, independent reference
    cast = x[inside].astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    np.testing.assert_array_equal(ref_decode_e2m1(codes[inside]), cast)


def ref_nvfp4(x):
    xb = np.asarray(x, F32).reshape(*x.shape[:-1], -1, 16)
    amax = np.abs(x).max()
    ts = F32(1.0) if amax == 0 else F32(amax) / F32(6 * 448)
    bs = e4m3_bits(np.minimum((np.abs(xb).max(-1) / F32(6)) / ts, F32(448)))
    denom = e4m3_value(bs) * ts
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(denom[..., None] == 0, F32(0), xb / denom[..., None])
    return ref_encode_e2m1(y).reshape(x.shape), bs, ts, denom, y.reshape(x.shape)


def test_nvfp4_matches_reference():
    rng = np.random.default_rng(13)
    x = random_groups(rng, (4, 6, 256), 16)
    x[1, 2, 16:32] = 0.0  # zero block
    packed, block_scales, tensor_scale = jit(fp4.quantize_nvfp4)(x)
    codes_ref, bs_ref, ts_ref, denom, y = ref_nvfp4(x)
    assert packed.shape == (4, 6, 128) and block_scales.shape == (4, 6, 16) and tensor_scale.shape == ()
    assert packed.dtype == block_scales.dtype == jnp.uint8 and tensor_scale.dtype == jnp.float32
    assert float(tensor_scale) == ts_ref
    np.testing.assert_array_equal(np.asarray(block_scales), bs_ref)
    np.testing.assert_array_equal(np.asarray(packed), ref_pack(codes_ref))
    assert np.asarray(block_scales).max() == 0x7E  # the block holding amax(x) gets scale 448
    assert block_scales[1, 2, 1] == 0

    deq = np.asarray(jit(fp4.dequantize_nvfp4)(packed, block_scales, tensor_scale))
    d = np.repeat(denom, 16, axis=-1)
    np.testing.assert_array_equal(deq, ref_decode_e2m1(codes_ref).astype(F32) * d)  # fp32 product
    assert np.all(deq[1, 2, 16:32] == 0) and np.all(np.isfinite(deq))
    assert np.all(np.abs(x - deq) <= e2m1_error_bound(y) * d * (1 + 1e-6))


def test_nvfp4_all_zero_tensor():
    packed, block_scales, tensor_scale = jit(fp4.quantize_nvfp4)(np.zeros((2, 32), F32))
    assert float(tensor_scale) == 1.0
    assert not np.any(np.asarray(packed)) and not np.any(np.asarray(block_scales))
    assert not np.any(np.asarray(jit(fp4.dequantize_nvfp4)(packed, block_scales, tensor_scale)))


def test_mxfp4_matches_reference_and_power_of_two_rule():
    rng = np.random.default_rng(14)
    exponents = rng.integers(-60, 60, (8, 16, 1)).repeat(32, -1).reshape(8, 512)
    x = (rng.standard_normal((8, 512)) * 2.0**exponents).astype(F32)
    x[0, :32] = 0.0  # zero block
    x[0, 32:64] = rng.uniform(-1, 1, 32) * 2.0**-149 * 100  # subnormal block: clamps to 2^-127
    x[0, 64:96] = 0.0
    x[0, 64] = 2.0**-126  # floor(log2) − 2 = −128 clamps to −127 (code 0), value 2 → code 4
    x[0, 96:128] = rng.uniform(-1, 1, 32) * 2.0**127  # largest exponents
    packed, scales = jit(fp4.quantize_mxfp4)(x)
    assert packed.shape == (8, 256) and scales.shape == (8, 16) and scales.dtype == jnp.uint8

    xb = x.astype(np.float64).reshape(8, 16, 32)
    amax = np.abs(xb).max(-1)
    mantissa, exponent = np.frexp(amax)  # amax = m·2^e with m in [0.5, 1): floor(log2) = e − 1
    shared = np.clip(np.where(amax == 0, -127, exponent - 1) - 2, -127, 127)
    np.testing.assert_array_equal(np.asarray(scales), shared + 127)
    y = xb / 2.0 ** shared[..., None]
    codes_ref = ref_encode_e2m1(y).reshape(x.shape)
    np.testing.assert_array_equal(np.asarray(packed), ref_pack(codes_ref))
    assert scales[0, 0] == 0 and scales[0, 1] == 0 and scales[0, 2] == 0
    assert np.all(codes_ref[0, :32] == 0) and codes_ref[0, 64] == 4
    normal = (amax > 2.0**-125) & (amax < np.inf)  # not clamped: amax / 2^shared_exp in [4, 8)
    ratio = (amax / 2.0**shared)[normal]
    assert np.all((ratio >= 4) & (ratio < 8))

    deq = np.asarray(jit(fp4.dequantize_mxfp4)(packed, scales))
    scale = np.repeat(2.0**shared, 32, axis=-1)
    np.testing.assert_array_equal(deq, ref_decode_e2m1(codes_ref) * scale)
    assert np.all(np.abs(x - deq) <= e2m1_error_bound(y.reshape(x.shape)) * scale)


# ----------------------------------------------------------------------------------------------------
# jit


def test_eager_matches_jit():
    """The other tests run jitted; eager (op-by-op) execution must give the same bits."""
    rng = np.random.default_rng(15)
    x = random_groups(rng, (4, 256), 64)
    g_idx = (np.argsort(rng.permutation(256)) // 64).astype(np.int32)
    calls = [
        (svdq.quantize_weights, {"scale_dtype": jnp.bfloat16}, (x,)),
        (fp8.quantize_activations, {}, (x,)),
        (
            lambda w, g: w4a16.quantize(w, group_size=64, zero_point=True, scale_dtype=jnp.bfloat16, g_idx=g),
            {},
            (x, g_idx),
        ),
        (formats.quantize_mxfp4, {}, (x,)),
    ]
    for fn, static, args in calls:
        eager = jax.tree.leaves(fn(*args, **static))
        jitted = jax.tree.leaves(jit(fn, **static)(*args))
        for a, b in zip(eager, jitted, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_div_rn_is_ieee_division_under_jit():
    rng = np.random.default_rng(16)
    a = rng.standard_normal((64, 256)).astype(F32)
    b = (np.abs(rng.standard_normal((64, 1))) + 0.1).astype(F32)
    np.testing.assert_array_equal(np.asarray(jax.jit(formats.div_rn)(a, b)), a / b)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: formats.div_rn(v, 7))(a)), a / F32(7))
