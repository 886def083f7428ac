"""jax_w4a4.formats.w4a16_layout: the kernel layout of w4a16 weights (CPU, fast).

Checks the prepacked words against an independent per-element statement of the layout, the
round trip (bit-exact), the act-order permutation, the shape rules, and that decoding the words the
way the CUDA kernel does (lop3 + the 0x6400 / 0x4300 exponent tricks) gives exactly the m16n8k16
A-fragment values the PTX ISA assigns to every lane.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_w4a4.formats import w4a16, w4a16_layout as layout

SHAPES = [(32, 64), (64, 128), (96, 576), (128, 1536), (50, 70), (16, 2)]


def _logical(rng, n, k):
    return rng.integers(0, 256, (n, k // 2), dtype=np.uint8)


def _nibbles(qweight):
    q = np.empty((qweight.shape[0], qweight.shape[1] * 2), np.uint8)
    q[:, 0::2] = qweight & 0xF
    q[:, 1::2] = qweight >> 4
    return q


def _spec_prepack(qweight, perm=None):
    """The layout, element by element (module docstring of w4a16_layout)."""
    q = _nibbles(qweight)
    n, k = q.shape
    perm = np.arange(k) if perm is None else np.asarray(perm)
    rows, cols = layout.prepacked_shape(n, k)
    kp = cols // 2
    words = np.zeros((rows - 1, cols), np.uint64)
    for nb in range(rows - 1):
        for a in range(kp // 64):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for j in range(4):
                    word = 0
                    for p in range(8):
                        row = 16 * nb + g + 8 * (p & 1)
                        col = 64 * a + 16 * j + 2 * t + 8 * ((p >> 1) & 1) + (p >> 2)
                        if row < n and col < k:
                            word |= int(q[row, perm[col]]) << (4 * p)
                    words[nb, 128 * a + 4 * lane + j] = word
    tail = np.zeros(cols, np.int64)
    tail[:kp] = np.concatenate([perm, np.arange(k, kp)])
    tail[kp] = int((perm != np.arange(k)).any())
    body = words.astype(np.uint32).view(np.int32)
    return np.concatenate([body, tail.astype(np.int32)[None]], axis=0)


@pytest.mark.parametrize("n,k", SHAPES)
def test_prepack_matches_the_element_spec_and_round_trips(rng, n, k):
    qweight = _logical(rng, n, k)
    packed = layout.prepack(qweight)
    assert packed.dtype == layout.PREPACKED_DTYPE
    assert packed.shape == layout.prepacked_shape(n, k)
    np.testing.assert_array_equal(np.asarray(packed), _spec_prepack(qweight))
    np.testing.assert_array_equal(np.asarray(layout.unprepack(packed, n, k)), qweight)
    np.testing.assert_array_equal(np.asarray(jax.jit(layout.prepack)(qweight)), np.asarray(packed))
    unpack = jax.jit(layout.unprepack, static_argnums=(1, 2))
    np.testing.assert_array_equal(np.asarray(unpack(packed, n, k)), qweight)


def _act_order_g_idx(rng, k, group_size):
    """GPTQ act-order: groups are consecutive runs of a random column order."""
    return (np.argsort(rng.permutation(k)) // group_size).astype(np.int32)


@pytest.mark.parametrize("n,k,group_size", [(64, 256, 32), (32, 576, 64), (96, 1024, 128), (32, 128, -1)])
def test_act_order_permutes_k_and_round_trips(rng, n, k, group_size):
    qweight = _logical(rng, n, k)
    g_idx = _act_order_g_idx(rng, k, k if group_size == -1 else group_size)
    packed = layout.prepack(qweight, g_idx=g_idx, group_size=group_size)
    perm = np.argsort(g_idx, kind="stable")
    np.testing.assert_array_equal(np.asarray(packed), _spec_prepack(qweight, perm))
    np.testing.assert_array_equal(np.asarray(layout.permutation(packed, k)), perm)
    # Stored column i belongs to group i // group_size: what the kernel assumes.
    size = k if group_size == -1 else group_size
    np.testing.assert_array_equal(g_idx[perm], np.arange(k) // size)
    np.testing.assert_array_equal(np.asarray(layout.unprepack(packed, n, k)), qweight)
    traced = jax.jit(lambda q, g: layout.prepack(q, g_idx=g, group_size=group_size))(qweight, g_idx)
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(packed))


def test_identity_permutation_is_not_flagged(rng):
    qweight = _logical(rng, 32, 256)
    trivial = (np.arange(256) // 64).astype(np.int32)
    packed = np.asarray(layout.prepack(qweight, g_idx=trivial, group_size=64))
    assert packed[-1, 256] == 0
    np.testing.assert_array_equal(packed, np.asarray(layout.prepack(qweight)))


def test_act_order_rejects_unequal_groups(rng):
    qweight = _logical(rng, 32, 128)
    g_idx = np.zeros(128, np.int32)
    g_idx[:80] = 1  # group 1 holds 80 columns, group 0 holds 48
    with pytest.raises(ValueError, match="g_idx"):
        layout.prepack(qweight, g_idx=g_idx, group_size=64)
    with pytest.raises(ValueError, match="g_idx"):
        layout.prepack(qweight, g_idx=np.full(128, 2, np.int32), group_size=64)
    with pytest.raises(ValueError, match="group_size"):
        layout.prepack(qweight, g_idx=_act_order_g_idx(rng, 128, 64))


def test_unprepack_rejects_the_wrong_shape(rng):
    packed = layout.prepack(_logical(rng, 32, 128))
    with pytest.raises(ValueError, match="prepacked must be int32"):
        layout.unprepack(packed, 64, 128)


def test_check_shape_names_the_argument_and_the_multiple():
    layout.check_shape(4096, 4096, 128)
    layout.check_shape(576, 1536, 32)
    layout.check_shape(1536, 576, 576)  # per channel: group_size == K
    layout.check_shape(1536, 576, -1)
    with pytest.raises(ValueError, match=r"N \(scales.shape\[1\]\) must be a multiple of 32, got 48"):
        layout.check_shape(48, 256, 64)
    with pytest.raises(ValueError, match=r"K \(x.shape\[-1\]\) must be a multiple of 64, got 96"):
        layout.check_shape(64, 96, 32)
    with pytest.raises(ValueError, match=r"group_size must be one of"):
        layout.check_shape(64, 256, 16)
    with pytest.raises(ValueError, match=r"K=576 must be a multiple of group_size=128"):
        layout.check_shape(64, 576, 128)


def test_prepacked_scales_are_group_major_and_invert_exactly(rng):
    """The kernel reads one group's scales for a run of rows as one contiguous TMA box: (K/G, N)."""
    scales = jnp.asarray(rng.standard_normal((96, 6)), jnp.bfloat16)  # (N, K/G)
    zeros = jnp.asarray(rng.integers(0, 16, (96, 6)), jnp.uint8)
    for logical in (scales, zeros):
        kernel = layout.prepack_scales(logical)
        assert kernel.shape == (6, 96) and kernel.dtype == logical.dtype
        np.testing.assert_array_equal(np.asarray(kernel[2, 10:20]), np.asarray(logical[10:20, 2]))
        np.testing.assert_array_equal(np.asarray(layout.unprepack_scales(kernel)), np.asarray(logical))
    with pytest.raises(ValueError, match=r"must be 2-D \(N, K/G\)"):
        layout.prepack_scales(scales[0])
    with pytest.raises(ValueError, match=r"must be 2-D \(K/G, N\)"):
        layout.unprepack_scales(scales[None])


# ------------------------------------------------------------------ what the kernel's bit tricks read


def _halves(bits, fp16):
    bits = np.asarray(bits, np.uint32)
    low, high = (bits & 0xFFFF).astype(np.uint16), (bits >> 16).astype(np.uint16)
    view = (lambda h: h.view(np.float16)) if fp16 else (lambda h: h.view(ml_dtypes.bfloat16))
    return view(low).astype(np.float64), view(high).astype(np.float64)


def _kernel_fragment(word, zero_lo, zero_hi, fp16):
    """The CUDA kernel's Dequantize(): the 4 A registers (8 values) of one word, in float64."""
    w = np.uint32(word)
    if fp16:
        magic = np.uint32(0x64006400)
        sources = [(w & 0x000F000F) | magic, (w & 0x00F000F0) | magic,
                   ((w >> 8) & 0x000F000F) | magic, ((w >> 8) & 0x00F000F0) | magic]
        scales = [1.0, 1 / 16, 1.0, 1 / 16]
        offsets = [1024 + zero_lo, 64 + zero_hi, 1024 + zero_lo, 64 + zero_hi]
    else:
        magic = np.uint32(0x43004300)
        sources = [((w >> (4 * p)) & 0x000F000F) | magic for p in range(4)]
        scales = [1.0] * 4
        offsets = [128 + zero_lo, 128 + zero_hi, 128 + zero_lo, 128 + zero_hi]
    values = []
    for src, scale, offset in zip(sources, scales, offsets):
        low, high = _halves(src, fp16)
        values += [low * scale - offset, high * scale - offset]
    return np.array(values)  # a0..a7


@pytest.mark.parametrize("fp16", [True, False])
def test_kernel_dequantization_gives_the_ptx_a_fragments(rng, fp16):
    """Lane L's register p holds A[row][col] with row = g + 8 (p & 1), col = 2t + 8 (p >> 1) (+1)."""
    n, k = 32, 128
    qweight = _logical(rng, n, k)
    q = _nibbles(qweight).astype(np.float64)
    zeros = rng.integers(0, 16, n)
    packed = np.asarray(layout.prepack(qweight)).view(np.uint32)
    for nb in range(n // 16):
        for a in range(k // 64):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for j in range(4):
                    word = packed[nb, 128 * a + 4 * lane + j]
                    rows = 16 * nb + np.array([g, g, g + 8, g + 8, g, g, g + 8, g + 8])
                    cols = 64 * a + 16 * j + 2 * t + np.array([0, 1, 0, 1, 8, 9, 8, 9])
                    expected = q[rows, cols] - zeros[rows]
                    got = _kernel_fragment(word, zeros[16 * nb + g], zeros[16 * nb + g + 8], fp16)
                    np.testing.assert_array_equal(got, expected)


def test_prepack_of_quantized_weights_round_trips(rng):
    w = rng.standard_normal((64, 512)).astype(np.float32)
    g_idx = _act_order_g_idx(rng, 512, 128)
    q = w4a16.quantize(jnp.asarray(w), group_size=128, zero_point=True, scale_dtype=jnp.bfloat16, g_idx=g_idx)
    packed = layout.prepack(q.qweight, g_idx=g_idx, group_size=128)
    np.testing.assert_array_equal(np.asarray(layout.unprepack(packed, 64, 512)), np.asarray(q.qweight))
