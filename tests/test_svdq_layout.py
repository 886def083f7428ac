"""jax_w4a4.formats.svdq_layout: the kernel layout of svdq int4 weights (CPU, fast).

Checks the prepacked bytes against an independent per-element statement of the layout, the round trip
(bit-exact, with padding), the shape rules, and that the 16 bytes a consumer thread of the sm90 kernel
loads, decoded the way the kernel does (a NumPy model of its prmt table lookup), are exactly the values
the PTX ISA's wgmma .m64nNk32 8-bit A-fragment layout assigns to that thread for both k32 steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_w4a4.formats import int4, svdq_layout as layout

SHAPES = [(64, 64), (128, 128), (192, 384), (50, 70), (64, 2), (130, 200)]


def _logical(rng, n, k):
    return rng.integers(0, 256, (n, k // 2), dtype=np.uint8)


def _signed_values(qweight):
    """Logical bytes -> int (N, K) values in -8..7 (independent of the package's unpacker)."""
    nibbles = np.stack([qweight & 0xF, qweight >> 4], axis=-1).reshape(qweight.shape[0], -1).astype(np.int64)
    return np.where(nibbles >= 8, nibbles - 16, nibbles)


def _spec_prepack(qweight):
    """The layout, byte by byte, from the module docstring."""
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    nb, kb, size = layout.prepacked_shape(n, k)
    out = np.zeros((nb, kb, size), np.uint8)
    for b_n in range(nb):
        for b_k in range(kb):
            for tid in range(128):
                w, lane = divmod(tid, 32)
                g, t = divmod(lane, 4)
                for j in range(4):
                    for p in range(4):
                        row = 64 * b_n + 16 * w + g + 8 * (p >> 1)
                        col = 64 * b_k + 16 * j + 4 * t + 2 * (p & 1)
                        if row < n and col < k:
                            out[b_n, b_k, 16 * tid + 4 * j + p] = qweight[row, col // 2]
    return out


@pytest.mark.parametrize("n,k", SHAPES)
def test_prepack_matches_the_byte_spec(rng, n, k):
    qweight = _logical(rng, n, k)
    got = np.asarray(layout.prepack(jnp.asarray(qweight)))
    assert got.dtype == np.uint8 and got.shape == layout.prepacked_shape(n, k)
    np.testing.assert_array_equal(got, _spec_prepack(qweight))


@pytest.mark.parametrize("n,k", SHAPES)
def test_round_trip_is_bit_exact(rng, n, k):
    qweight = _logical(rng, n, k)
    prepacked = jax.jit(layout.prepack)(qweight)
    back = jax.jit(layout.unprepack, static_argnums=(1, 2))(prepacked, n, k)
    np.testing.assert_array_equal(np.asarray(back), qweight)


def test_prepacked_scales_follow_the_stage_major_spec(rng):
    """``[ks, n, h] = s_w[n, 2 ks + h]``: a 128-column tile's scales of one K-stage are 512 contiguous bytes,
    in the [column][group 0, group 1] order the kernel's bulk copy lands in shared memory; round trip exact."""
    n, k = 256, 384
    wscales = jnp.asarray(rng.standard_normal((n, k // 64)), jnp.bfloat16)
    packed = jax.jit(layout.prepack_scales)(wscales)
    assert packed.shape == layout.prepacked_scales_shape(n, k) == (3, 256, 2) and packed.dtype == jnp.bfloat16
    logical, flat = np.asarray(wscales, np.float32), np.asarray(packed, np.float32).reshape(-1)
    for ks in range(k // 128):
        for n0 in (0, 128):
            tile = flat[(ks * n + n0) * 2 : (ks * n + n0 + 128) * 2].reshape(128, 2)
            np.testing.assert_array_equal(tile, logical[n0 : n0 + 128, 2 * ks : 2 * ks + 2])
    np.testing.assert_array_equal(np.asarray(jax.jit(layout.unprepack_scales)(packed)), np.asarray(wscales))


def test_prepack_is_a_byte_permutation(rng):
    """Aligned shapes: no padding, every logical byte appears exactly once (nibbles are not re-encoded)."""
    qweight = _logical(rng, 128, 256)
    prepacked = np.asarray(layout.prepack(qweight))
    assert prepacked.size == qweight.size
    np.testing.assert_array_equal(np.sort(prepacked.ravel()), np.sort(qweight.ravel()))


# ---- the kernel's register conversion and the PTX fragment layout -------------------------------

# e4m3 codes of 0..7 and of -8..-1, 4 per 32-bit word (byte 0 first): the kernel's prmt tables.
_POSITIVE = (0x44403800, 0x4E4C4A48)
_NEGATIVE = (0xCACCCED0, 0xB8C0C4C8)


def _prmt(a, b, selector):
    """PTX prmt.b32 (default mode, selector nibbles < 8): byte i = byte (selector nibble i) of {b:a}."""
    pool = (int(b) << 32) | int(a)
    out = 0
    for i in range(4):
        index = (int(selector) >> (4 * i)) & 0xF
        assert index < 8, "the kernel never uses the sign-replicate mode"
        out |= ((pool >> (8 * index)) & 0xFF) << (8 * i)
    return out


def _kernel_convert(words):
    """NumPy model of the kernel's Int4x8ToE4m3: 4 words of 8 int4 -> 8 registers of 4 e4m3 codes."""
    registers = []
    for w in (int(x) for x in words):
        index = w & 0x77777777
        select = ((w >> 1) & 0x44444444) | 0x32103210
        for half in (0, 16):
            positive = _prmt(*_POSITIVE, index >> half)
            negative = _prmt(*_NEGATIVE, index >> half)
            registers.append(_prmt(positive, negative, select >> half))
    return registers


def _e4m3_values(register):
    codes = np.array([(register >> (8 * i)) & 0xFF for i in range(4)], np.uint8)
    return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _ptx_a_fragment(values, warp, lane, k_step):
    """wgmma .m64nNk32 A fragment (8-bit) of one thread, from the PTX ISA figure: elements a0..a15.

    a0-a3: row groupID, columns 4 tid_in_group + (0..3); a4-a7: row groupID + 8, same columns;
    a8-a11 and a12-a15: as a0-a3 and a4-a7 with columns + 16. Rows offset by 16 * warp (warpgroup's
    64 rows), columns by 32 * k_step.
    """
    group, in_group = divmod(lane, 4)
    out = []
    for i in range(16):
        row = 16 * warp + group + (8 if (i // 4) % 2 else 0)
        col = 32 * k_step + 4 * in_group + (i % 4) + (16 if i >= 8 else 0)
        out.append(values[row, col])
    return np.array(out, np.float64)


def test_every_int4_code_converts_exactly():
    """The prmt tables map every nibble to the e4m3 code of its two's-complement value."""
    for nibble in range(16):
        word = nibble * 0x11111111
        expected = nibble - 16 if nibble >= 8 else nibble
        for register in _kernel_convert([word, 0, 0, 0])[:2]:
            np.testing.assert_array_equal(_e4m3_values(register), np.full(4, expected, np.float64))


@pytest.mark.parametrize("block_n,block_k", [(0, 0), (1, 2), (2, 1)])
def test_thread_loads_are_its_wgmma_a_fragments(rng, block_n, block_k):
    n, k = 192, 256
    qweight = _logical(rng, n, k)
    values = _signed_values(qweight)
    np.testing.assert_array_equal(values, np.asarray(int4.unpack_int4(qweight, signed=True)))
    prepacked = np.asarray(layout.prepack(qweight))
    block_values = values[64 * block_n : 64 * block_n + 64, 64 * block_k : 64 * block_k + 64]
    for warp in range(4):
        for lane in rng.choice(32, 8, replace=False):
            tid = 32 * warp + int(lane)
            loaded = prepacked[block_n, block_k, 16 * tid : 16 * tid + 16].view("<u4")  # one 16-byte load
            registers = _kernel_convert(loaded)
            for k_step in range(2):
                got = np.concatenate([_e4m3_values(r) for r in registers[4 * k_step : 4 * k_step + 4]])
                np.testing.assert_array_equal(got, _ptx_a_fragment(block_values, warp, int(lane), k_step))


# ---- argument checks ------------------------------------------------------------------------------


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="qweight must be uint8"):
        layout.prepack(jnp.zeros((64, 32), jnp.int8))
    with pytest.raises(ValueError, match="qweight must be uint8"):
        layout.prepack(jnp.zeros((64,), jnp.uint8))
    with pytest.raises(ValueError, match=r"prepacked must be uint8 \(1, 1, 2048\)"):
        layout.unprepack(jnp.zeros((1, 2, 2048), jnp.uint8), 64, 64)
    with pytest.raises(ValueError, match="k must be even"):
        layout.unprepack(jnp.zeros((1, 1, 2048), jnp.uint8), 64, 63)
    with pytest.raises(ValueError, match=r"K a multiple of 128 \(an even number of groups\), got \(64, 3\)"):
        layout.prepack_scales(jnp.zeros((64, 3), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"prepacked scales must be \(K/128, N, 2\), got \(64, 4\)"):
        layout.unprepack_scales(jnp.zeros((64, 4), jnp.bfloat16))


@pytest.mark.parametrize("n,k,arg", [(192, 128, "N"), (0, 128, "N"), (128, 192, "K"), (256, 64, "K")])
def test_check_shape_names_the_argument(n, k, arg):
    with pytest.raises(ValueError, match=rf"{arg} \("):
        layout.check_shape(n, k)


def test_check_shape_accepts_kernel_shapes():
    for n, k in [(128, 128), (3072, 12288), (14336, 4096)]:
        layout.check_shape(n, k)
