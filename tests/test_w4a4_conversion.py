"""The int4 -> e4m3 register conversions of csrc/kernels/sm90/w4a4_gemm.cu, instruction by instruction (CPU).

The kernel converts a word of 8 prepacked int4 weights into two wgmma A registers of 4 e4m3 bytes:
nibbles 0-3 -> `lo`, nibbles 4-7 -> `hi` (formats/svdq_layout.py). Prefill tiles use `Int4x8ToE4m3` (a
prmt table lookup: byte = e4m3(q)); decode tiles use `Int4x8ToOffsetE4m3` (byte = q + 8, which read as
e4m3 is (q + 8)·2^-9), whose offset the promotion cancels with the token's code sum, and 2^9 with α.
Here both sequences run on NumPy models of the PTX instructions (prmt.b32 default mode, lop3.b32, shr),
and are checked against ml_dtypes' e4m3 and against each other: every nibble value in every position,
both 16-bit halves exhaustively, random words, the real prepacked layout, and the promoted dot product.
"""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from jax_w4a4.formats import svdq_layout as layout

U32 = np.uint32


# ---- PTX instruction models (vectorized over uint32 arrays) ------------------------------------------


def prmt(a, b, selector):
    """prmt.b32 d, a, b, c (default mode): byte i of d = byte (c nibble i & 7) of {b, a}; a nibble with
    bit 3 set replicates the sign (bit 7) of that byte instead."""
    a, b, selector = (np.asarray(v, np.uint64) for v in (a, b, selector))
    pool = (b << np.uint64(32)) | a
    out = np.zeros(np.broadcast(a, b, selector).shape, np.uint64)
    for i in range(4):
        nibble = (selector >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (pool >> (np.uint64(8) * (nibble & np.uint64(7)))) & np.uint64(0xFF)
        sign = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        byte = np.where(nibble & np.uint64(8), sign, byte)
        out |= byte << np.uint64(8 * i)
    return out.astype(U32)


def lop3(a, b, c, lut):
    """lop3.b32 d, a, b, c, lut: bit j of d = bit (4 a_j + 2 b_j + c_j) of lut (a = 0xF0, b = 0xCC, c = 0xAA)."""
    a, b, c = (np.asarray(v, U32) for v in (a, b, c))
    out = np.zeros(np.broadcast(a, b, c).shape, U32)
    for k in range(8):
        if lut >> k & 1:
            out |= (a if k & 4 else ~a) & (b if k & 2 else ~b) & (c if k & 1 else ~c)
    return out


def shr(a, n):
    return np.asarray(a, U32) >> U32(n)


# ---- the two conversions, as written in w4a4_gemm.cu ------------------------------------------------

_POSITIVE = (0x44403800, 0x4E4C4A48)  # e4m3 of 0..3, 4..7 (byte 0 first)
_NEGATIVE = (0xCACCCED0, 0xB8C0C4C8)  # e4m3 of -8..-5, -4..-1


def int4x8_to_e4m3(w):
    """Int4x8ToE4m3 (prefill): index = w & 0x77777777, select = ((w >> 1) & 0x44444444) | 0x32103210."""
    index = lop3(w, 0x77777777, 0, 0xC0)
    select = lop3(lop3(shr(w, 1), 0x44444444, 0, 0xC0), 0x32103210, 0, 0xFC)
    regs = []
    for index_h, select_h in ((index, select), (shr(index, 16), shr(select, 16))):
        regs.append(prmt(prmt(*_POSITIVE, index_h), prmt(*_NEGATIVE, index_h), select_h))
    return tuple(regs)


def int4x8_to_offset_e4m3(w):
    """Int4x8ToOffsetE4m3 (decode): two lop3 0x6A ((a & b) ^ c), one shr, two prmt."""
    even = lop3(w, 0x0F0F0F0F, 0x08080808, 0x6A)
    odd = lop3(shr(w, 4), 0x0F0F0F0F, 0x08080808, 0x6A)
    return prmt(even, odd, 0x5140), prmt(even, odd, 0x7362)



# ---- helpers ---------------------------------------------------------------------------------------


def _bytes(registers):
    """(..., 2) registers -> (..., 8) bytes: lo bytes 0-3, then hi bytes 0-3."""
    regs = np.stack(registers, axis=-1).astype(U32)
    return np.stack([(regs[..., r] >> U32(8 * i)) & U32(0xFF) for r in range(2) for i in range(4)], -1).astype(np.uint8)


def _e4m3(codes):
    return np.asarray(codes, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _signed_nibbles(w):
    """(...,) words -> (..., 8) int4 values, nibble i = bits 4i..4i+3 (two's complement)."""
    nibbles = np.stack([(np.asarray(w, U32) >> U32(4 * i)) & U32(0xF) for i in range(8)], -1).astype(np.int64)
    return np.where(nibbles >= 8, nibbles - 16, nibbles)


def _check_words(words):
    q = _signed_nibbles(words)
    old = _bytes(int4x8_to_e4m3(words))
    new = _bytes(int4x8_to_offset_e4m3(words))
    np.testing.assert_array_equal(_e4m3(old), q)  # the table lookup: e4m3(q), exact
    np.testing.assert_array_equal(new, q + 8)  # the offset code: the byte q + 8 ...
    np.testing.assert_array_equal(_e4m3(new), (q + 8) * 2.0**-9)  # ... which is (q + 8)·2^-9 in e4m3
    np.testing.assert_array_equal(_e4m3(new) * 2.0**9 - 8, _e4m3(old))  # the same weights, byte for byte


# ---- tests -----------------------------------------------------------------------------------------


def test_prmt_and_lop3_models():
    assert int(prmt(0x33221100, 0x77665544, 0x5140)) == 0x55114400
    assert int(prmt(0x33221100, 0x77665544, 0x7362)) == 0x77336622
    assert int(prmt(0x000080FF, 0, 0x4449)) == 0x000000FF and int(prmt(0x00007F00, 0, 0x4449)) == 0  # sign mode
    assert int(lop3(0xDEADBEEF, 0x0F0F0F0F, 0x08080808, 0x6A)) == (0xDEADBEEF & 0x0F0F0F0F) ^ 0x08080808


def test_offset_code_is_linear_in_e4m3():
    """Bytes 0..15 read as e4m3 are exactly u·2^-9 (subnormals below 8, exponent field 1 from 8)."""
    np.testing.assert_array_equal(_e4m3(np.arange(16)), np.arange(16) * 2.0**-9)


def test_every_value_in_every_position(rng):
    for position in range(8):
        for value in range(16):
            others = rng.integers(0, 2**32, 64, dtype=np.uint64).astype(U32)
            mask = U32(0xF << (4 * position))
            words = (others & ~mask) | U32(value << (4 * position))
            _check_words(words)


@pytest.mark.parametrize("half", [0, 16])
def test_each_16_bit_half_exhaustively(rng, half):
    values = np.arange(2**16, dtype=U32) << U32(half)
    others = rng.integers(0, 2**16, 2**16, dtype=np.uint64).astype(U32) << U32(16 - half)
    _check_words(values | others)


def test_random_words(rng):
    words = rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(U32)
    _check_words(np.concatenate([words, np.array([0, 0xFFFFFFFF, 0x88888888, 0x77777777], U32)]))


def test_prepacked_thread_fragments_are_offset_codes(rng):
    """Through the real prepack: each thread's converted registers hold (w + 8)·2^-9 of exactly the
    elements the PTX wgmma .m64nNk32 8-bit A fragment assigns to it (register r of k-step s: row
    16 warp + g + 8 (r & 1), columns 32 s + 16 (r >> 1) + 4 t + 0..3)."""
    n, k = 128, 128
    logical = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    values = np.stack([logical & 0xF, logical >> 4], -1).reshape(n, k).astype(np.int64)
    values = np.where(values >= 8, values - 16, values)
    prepacked = np.asarray(layout.prepack(logical))
    for block_n in range(n // 64):
        for block_k in range(k // 64):
            block = values[64 * block_n : 64 * block_n + 64, 64 * block_k : 64 * block_k + 64]
            words = prepacked[block_n, block_k].view("<u4").reshape(128, 4)  # thread tid: 16 bytes
            lo, hi = int4x8_to_offset_e4m3(words)
            registers = np.stack([lo, hi], -1).reshape(128, 8)  # word j -> registers 2j, 2j + 1
            got = _e4m3(np.stack([(registers >> U32(8 * i)) & U32(0xFF) for i in range(4)], -1).astype(np.uint8))
            tid = np.arange(128)
            warp, g, t = tid // 32, (tid % 32) // 4, tid % 4
            for o in range(8):
                s, r = divmod(o, 4)
                rows = 16 * warp + g + 8 * (r & 1)
                cols = 32 * s + 16 * (r >> 1) + 4 * t
                want = np.stack([block[rows, cols + e] for e in range(4)], -1)
                np.testing.assert_array_equal(got[:, o], (want + 8) * 2.0**-9)


def _round_f32(value: Fraction) -> float:
    """An exact rational rounded once to float32, ties to even (no double rounding through float64)."""
    if value == 0:
        return 0.0
    sign, value = (-1, -value) if value < 0 else (1, value)
    exponent = math.floor(math.log2(value.numerator) - math.log2(value.denominator)) - 23
    while value / Fraction(2) ** exponent >= 2**24:
        exponent += 1
    while value / Fraction(2) ** exponent < 2**23:
        exponent -= 1
    scaled = value / Fraction(2) ** exponent
    whole, rest = divmod(scaled.numerator, scaled.denominator)
    if 2 * rest > scaled.denominator or (2 * rest == scaled.denominator and whole % 2):
        whole += 1
    return float(np.float32(sign * whole * 2.0**exponent))


def _f32(value) -> Fraction:
    return Fraction(float(np.float32(value)))


@pytest.mark.parametrize("act", ["int4", "uint4", "fp8"])
def test_promotion_records_cancel_the_offset(rng, act):
    """One unit (64 k) of one output, as PromoteOffset computes it: the wgmma's partial 2^-9 Σ x·(q + 8), the
    token's promotion record (s_x, c = -2^-6·S·s_x in fp32, S = Σ x the code sum: exact in fp32 in any order,
    multiples of 2^-9 below 2^15), then fma(partial, s_x, c). For int4/uint4 codes c is exact, so the result is s_x·2^-9 Σ x q rounded once:
    the bits a promotion of the exactly corrected partial gives (the correction wgmmas' of sessions 3-47); for
    fp8 codes c is rounded once more, an fp32 rounding of c, which the offset makes comparable to the result."""
    for _ in range(200):
        w = rng.integers(0, 2**32, 8, dtype=np.uint64).astype(U32)  # 64 weights
        q = _signed_nibbles(w).ravel()
        codes = _bytes(int4x8_to_offset_e4m3(w)).ravel()
        if act == "fp8":
            x_codes = rng.integers(0, 256, 64).astype(np.uint8)
            x_codes[(x_codes & 0x7F) == 0x7F] = 0  # drop the NaN codes
            x = _e4m3(x_codes)
            s_x = float(np.float32(rng.uniform(0.01, 10.0)))
        else:
            x = rng.integers(-8, 8, 64) if act == "int4" else rng.integers(0, 16, 64)
            x = _e4m3(np.asarray(x, np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
            s_x = float(np.float32(rng.uniform(0.01, 10.0)).astype(ml_dtypes.bfloat16))
        partial = sum(Fraction(v) * Fraction(c) for v, c in zip(x, _e4m3(codes)))
        assert _f32(float(partial)) == partial  # the tensor core's fp32 partial holds it exactly here
        code_sum = np.float32(0)
        for v in rng.permutation(x):  # any order: the same bits
            code_sum = np.float32(code_sum + np.float32(v))
        assert Fraction(float(code_sum)) == sum(Fraction(v) for v in x)
        c = _round_f32(Fraction(-1, 64) * Fraction(float(code_sum)) * Fraction(s_x))
        promoted = _round_f32(partial * Fraction(s_x) + Fraction(c))
        corrected = _round_f32(sum(Fraction(v) * int(qv) for v, qv in zip(x, q)) * Fraction(1, 512) * Fraction(s_x))
        if act == "fp8":  # c's own rounding, relative to c (the offset's share), and the final one
            assert abs(promoted - corrected) <= 2.0**-23 * (abs(c) + abs(corrected)) + 2.0**-126
        else:
            assert promoted == corrected
