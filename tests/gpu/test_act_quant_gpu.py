"""act_quant on the GPU (csrc/kernels/sm90/act_quant.cu) against jax_w4a4.reference.act_quant.

The kernel runs through jax_w4a4.ops.act_quant under jax.jit on the GPU; the reference runs on the CPU
(IEEE division everywhere) on the same inputs. Every output element is compared: q (one e4m3 code per
value for every format) bit for bit (at most one code off at a documented rounding tie; the kernel is
designed to be exact; an int4/uint4 zero must be 0x00, never -0), scales exactly, LA to
fp32-accumulation tolerance. Before each kernel run the allocator is filled with poison of the
outputs' sizes, so an element the kernel forgot to write shows up as a mismatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_w4a4 import budget, ops, reference
from jax_w4a4.ops import _library

pytestmark = pytest.mark.gpu

FORMATS = ("int4", "uint4", "fp8")
DTYPES = (jnp.bfloat16, jnp.float16)
ROWS = (1, 7, 64, 333, 4096)
KS = (128, 3072, 4096)
RANKS = (0, 16, 32, 128)


def _cpu():
    return jax.devices("cpu")[0]


def _gpu():
    return jax.devices("cuda")[0]


def make_inputs(rng, lead, k, r, dtype, act_format):
    """Random activations with group-to-group spread, exact zeros and -0, one all-zero group."""
    spread = np.exp2(rng.uniform(-3, 3, (*lead, k // 64, 1))).repeat(64, -1).reshape(*lead, k)
    x = rng.standard_normal((*lead, k)) * spread
    if act_format == "uint4":
        x = x + 0.5  # mostly non-negative (post-GELU + shift); the negatives must saturate to 0
    x = np.where(rng.random(x.shape) < 0.01, 0.0, x)
    x = np.where(rng.random(x.shape) < 0.01, -0.0, x)
    x.reshape(-1, k)[0, :128] = 0.0  # an all-zero group: scale 0, q 0
    smooth = rng.uniform(0.25, 4.0, k).astype(np.float32)
    lora_down = rng.standard_normal((k, r)) * 0.05
    return jnp.asarray(x, dtype), jnp.asarray(smooth), jnp.asarray(lora_down, dtype)


def _poison_allocator(x, lora_down, act_format):
    """Allocate and free output-sized buffers full of poison, which the kernel's outputs then reuse."""
    lead, k, r = x.shape[:-1], x.shape[-1], lora_down.shape[1]
    s_dtype = jnp.float32 if act_format == "fp8" else x.dtype
    bufs = [
        jnp.full((*lead, k), 0xA5, jnp.uint8, device=_gpu()),
        jnp.full((*lead, k // (128 if act_format == "fp8" else 64)), jnp.nan, s_dtype, device=_gpu()),
        jnp.full((*lead, r), jnp.nan, jnp.float32, device=_gpu()),
    ]
    jax.block_until_ready(bufs)
    del bufs


def run_kernel(x, smooth, lora_down, act_format):
    _poison_allocator(x, lora_down, act_format)
    args = jax.device_put((x, smooth, lora_down), _gpu())
    fn = jax.jit(ops.act_quant, static_argnames="act_format")
    return [np.asarray(a) for a in fn(*args, act_format=act_format)]


def run_reference(x, smooth, lora_down, act_format):
    args = jax.device_put((x, smooth, lora_down), _cpu())
    fn = jax.jit(reference.act_quant, static_argnames="act_format")
    return [np.asarray(a) for a in fn(*args, act_format=act_format)]


# e4m3 code of every integer -8..15 (the int4/uint4 values), as the reference encodes them: 0 is 0x00.
_INT_CODES = {v: int(np.array(v, np.float32).astype(jnp.float8_e4m3fn).view(np.uint8)) for v in range(-8, 16)}


def _codes(q, act_format):
    """Ordinal code of every quantized element: e4m3 codes in value order (fp8), or the integer value
    (int4/uint4; a byte that is not the code of an integer of the format's range fails here)."""
    if act_format == "fp8":
        magnitude = (q & 0x7F).astype(np.int32)
        return np.where(q & 0x80, -magnitude, magnitude)
    values = range(-8, 8) if act_format == "int4" else range(16)
    table = np.full(256, 1000, np.int32)  # far from every value: a stray byte fails max_diff <= 1
    for v in values:
        table[_INT_CODES[v]] = v
    return table[q]


def assert_matches(got, want, act_format, k, require_exact=False):
    (q, s, la), (q_ref, s_ref, la_ref) = got, want
    assert q.shape == q_ref.shape == (*q.shape[:-1], k) and q.dtype == q_ref.dtype == np.uint8
    assert s.shape == s_ref.shape and s.dtype == s_ref.dtype
    assert la.shape == la_ref.shape and la.dtype == la_ref.dtype == np.float32

    # Scales: bit for bit.
    s_bits, s_ref_bits = s.view(np.uint32 if s.dtype == np.float32 else np.uint16), s_ref.view(
        np.uint32 if s.dtype == np.float32 else np.uint16)
    bad_scales = np.flatnonzero(s_bits != s_ref_bits)
    assert bad_scales.size == 0, (
        f"{bad_scales.size} of {s.size} scales differ, first at flat index {bad_scales[0]}: "
        f"{s.reshape(-1)[bad_scales[0]]} vs {s_ref.reshape(-1)[bad_scales[0]]}")

    # q: exact except at a rounding tie, and then one code off.
    codes, codes_ref = _codes(q, act_format), _codes(q_ref, act_format)
    exact = np.mean(q == q_ref)
    max_diff = int(np.max(np.abs(codes - codes_ref))) if codes.size else 0
    if require_exact:
        assert exact == 1.0, f"q: {np.sum(q != q_ref)} of {q.size} bytes differ (max {max_diff} codes)"
    assert exact >= 0.9999 and max_diff <= 1, f"q: {exact:.6%} bytes exact, max difference {max_diff} codes"

    # LA: fp32 accumulation in another order; an error this size means a missing or wrong term.
    assert np.all(np.isfinite(la)), "LA has non-finite elements"
    if la.size:
        diff, ref = (la - la_ref).astype(np.float64), la_ref.astype(np.float64)
        rel = np.linalg.norm(diff) / max(np.linalg.norm(ref), 1e-30)
        assert rel < 1e-5 * np.sqrt(k), f"LA relative Frobenius error {rel:.3e} >= {1e-5 * np.sqrt(k):.3e}"


def _cases():
    # Every (M, K) with every format and dtype; the rank cycles through RANKS so each rank meets
    # every M and every K (test_rank_buckets sweeps the ranks at fixed shapes).
    for i, m in enumerate(ROWS):
        for j, k in enumerate(KS):
            r = RANKS[(i + j) % len(RANKS)]
            for act_format in FORMATS:
                for dtype in DTYPES:
                    yield pytest.param(m, k, r, act_format, dtype,
                                       id=f"M{m}-K{k}-r{r}-{act_format}-{jnp.dtype(dtype).name}")


@pytest.mark.parametrize("m,k,r,act_format,dtype", list(_cases()))
def test_matches_reference(rng, m, k, r, act_format, dtype):
    inputs = make_inputs(rng, (m,), k, r, dtype, act_format)
    assert_matches(run_kernel(*inputs, act_format), run_reference(*inputs, act_format), act_format, k)


@pytest.mark.parametrize("act_format", ["int4", "fp8"])
@pytest.mark.parametrize("m", [333, 1024, 4096])  # 16-row blocks; 64-row blocks from 1024 rows, and a full wave
@pytest.mark.parametrize("r", [16, 48, 64, 128, 144, 256])  # every rank bucket, full and partial
def test_rank_buckets(rng, m, r, act_format):
    inputs = make_inputs(rng, (m,), 3072, r, jnp.bfloat16, act_format)
    assert_matches(run_kernel(*inputs, act_format), run_reference(*inputs, act_format), act_format, 3072)


@pytest.mark.parametrize("act_format", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_dims(rng, act_format, dtype):
    inputs = make_inputs(rng, (3, 37), 4096, 32, dtype, act_format)
    got, want = run_kernel(*inputs, act_format), run_reference(*inputs, act_format)
    assert got[0].shape[:2] == got[2].shape[:2] == (3, 37)
    assert_matches(got, want, act_format, 4096)


@pytest.mark.parametrize("m", [4100, 8192])  # large M, rank <= 32: 64-row blocks
@pytest.mark.parametrize("act_format", ["int4", "fp8"])
def test_large_m_row_blocks(rng, m, act_format):
    """M = 4100 leaves a last row block of 4 rows; M = 8192 has 128 row blocks (a smaller K split)."""
    inputs = make_inputs(rng, (m,), 4096, 32, jnp.bfloat16, act_format)
    assert_matches(run_kernel(*inputs, act_format), run_reference(*inputs, act_format), act_format, 4096)


@pytest.mark.parametrize("m,k", [(512, 4096), (2048, 3072)])
@pytest.mark.parametrize("act_format", ["int4", "fp8"])
def test_split_cut_back_to_one_wave(rng, m, k, act_format):
    """On 132 SMs: 512 rows split K 12 ways (not a power of two: chunk ranges of 2 and 3 chunks, a partial last
    round in the LA sum); 2048 rows take 64-row blocks split 8 ways (tests/test_budget.py checks the plans)."""
    inputs = make_inputs(rng, (m,), k, 32, jnp.bfloat16, act_format)
    assert_matches(run_kernel(*inputs, act_format), run_reference(*inputs, act_format), act_format, k)


@pytest.mark.parametrize("m,k,r", [(1, 3072, 32), (7, 3072, 32), (16, 28672, 32), (3, 8192, 32), (16, 28672, 128),
                                   (16, 8192, 128), (1, 4096, 256), (5, 3072, 64)])
@pytest.mark.parametrize("act_format", ["int4", "fp8"])
def test_decode_split_on_idle_sms(rng, m, k, r, act_format):
    """Decode grids split K on past two chunks a CTA while they keep to one CTA per SM and the chunks saved outweigh
    the sum's added rounds (on 132 SMs: 3072 in 16 splits of 1-2 chunks, 28672 and 8192 in 64 at rank 32); the
    partials of up to 7 rows are summed by groups of lanes per LA quad (a butterfly), 16 rows by one lane per quad
    with 32 splits' loads in flight; ranks above 32 add several quads a thread over several rounds (16 x 28672 at
    rank 128: 64 splits in 8 rounds; 16 x 8192: 32 in 4; rank 256: 8 quads a thread)."""
    inputs = make_inputs(rng, (m,), k, r, jnp.bfloat16, act_format)
    assert_matches(run_kernel(*inputs, act_format), run_reference(*inputs, act_format), act_format, k)


@pytest.mark.parametrize("m,k", [(5, 192), (300, 3136)])  # K % 128 == 64: a half last chunk
@pytest.mark.parametrize("act_format", ["int4", "uint4"])
def test_k_multiple_of_64(rng, m, k, act_format):
    inputs = make_inputs(rng, (m,), k, 32, jnp.bfloat16, act_format)
    assert_matches(run_kernel(*inputs, act_format), run_reference(*inputs, act_format), act_format, k)


@pytest.mark.parametrize("act_format", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_path_edge_values(rng, act_format, dtype):
    """Values and lambdas outside the fast division's domain take the __fdiv_rn path: still bit exact.

    Every fp32 intermediate stays normal: the CPU reference flushes fp32 denormals to zero, the GPU
    (like IEEE) does not.
    """
    m, k = 96, 1024
    x = rng.standard_normal((m, k))
    tiny = 1e-30 if dtype == jnp.bfloat16 else 1e-7        # bf16 below 2^-60 / fp16 subnormal inputs
    x[0:8, 256:] *= tiny                                   # whole groups of tiny values
    x[8:16, 256::7] *= tiny                                # tiny values among normal ones
    x[16:24] *= 1e25 if dtype == jnp.bfloat16 else 6e3     # huge groups (fp16: scales overflow to inf)
    x[24:32] *= 1e-4                                       # fp16: subnormal scales
    x[32:40] = 0.0
    x[32:40, 1::2] = -0.0                                  # all-(signed)-zero groups
    smooth = rng.uniform(0.25, 4.0, k)
    smooth[:64] = 1e-7                                     # lambda below 2^-20
    smooth[64:128] = 3e7                                   # lambda above 2^20
    smooth[128:192] = -1.5                                 # negative lambda
    smooth[192:256] = 0.01                                 # fp16: X̂ beyond the fp16 range
    lora_down = rng.standard_normal((k, 16)) * 0.05
    inputs = jnp.asarray(x, dtype), jnp.asarray(smooth, jnp.float32), jnp.asarray(lora_down, dtype)
    got, want = run_kernel(*inputs, act_format), run_reference(*inputs, act_format)
    assert np.all(np.isfinite(want[2]))  # the inputs keep LA finite
    assert_matches(got, want, act_format, k, require_exact=True)


@pytest.mark.parametrize("act_format", FORMATS)
def test_random_data_is_bit_exact(rng, act_format):
    """The fast path is designed to reproduce IEEE division exactly: no tie exceptions on random data."""
    inputs = make_inputs(rng, (2048,), 4096, 32, jnp.bfloat16, act_format)
    assert_matches(run_kernel(*inputs, act_format), run_reference(*inputs, act_format), act_format, 4096,
                   require_exact=True)


def test_split_counters_are_rearmed(rng):
    """Nothing zeroes the K split's arrival counters before a launch (csrc/common/arrival_counters.h): each
    launch must leave them at 0. Runs split call sites on new data each time (a counter left armed would
    leave LA unwritten), then reads every counter back."""
    for _ in range(3):
        for m, k in ((1, 8192), (64, 8192), (4096, 4096)):  # 64, 32 and 8 K splits (on 132 SMs)
            inputs = make_inputs(rng, (m,), k, 32, jnp.bfloat16, "int4")
            assert_matches(run_kernel(*inputs, "int4"), run_reference(*inputs, "int4"), "int4", k)
    assert _library.armed_arrival_counters() == 0


@pytest.mark.parametrize("m", [1, 16, 64])  # lane groups per LA quad; one lane per quad; 4 row blocks
def test_deterministic(rng, m):
    """LA partials of a K split are summed in a fixed order: two runs agree bit for bit."""
    inputs = make_inputs(rng, (m,), 8192, 32, jnp.bfloat16, "int4")  # split 64, 64 and 32 ways along K on 132 SMs
    first, second = run_kernel(*inputs, "int4"), run_kernel(*inputs, "int4")
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def _raw_call(rows, k, r, act_format, *, q_last=None, workspace_bytes=None, num_sms=None):
    """The FFI target called directly (no abstract eval in front): results (q, scales, la, workspace)."""
    group = 128 if act_format == "fp8" else 64
    num_sms = _library.cuda_sm_count() if num_sms is None else num_sms
    if workspace_bytes is None:
        workspace_bytes = budget.act_quant_launch(rows, k, r, num_sms=max(num_sms, 1)).workspace_bytes
    out = (jax.ShapeDtypeStruct((rows, k if q_last is None else q_last), jnp.uint8),
           jax.ShapeDtypeStruct((rows, max(k // group, 1)), jnp.bfloat16),
           jax.ShapeDtypeStruct((rows, r), jnp.float32), jax.ShapeDtypeStruct((workspace_bytes,), jnp.uint8))
    call = jax.ffi.ffi_call("jax_w4a4_act_quant", out)
    return jax.jit(lambda *a: call(*a, act_format=act_format, num_sms=np.int64(num_sms)))


def test_handler_rejects_bad_shapes(rng):
    """The FFI handler validates on its own (second line of defence behind abstract eval)."""
    def args(rows, k, r):
        return jax.device_put((jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16), jnp.ones((k,), jnp.float32),
                               jnp.zeros((k, r), jnp.bfloat16)), _gpu())

    with pytest.raises(Exception, match="multiple of 64"):
        jax.block_until_ready(_raw_call(4, 96, 16, "int4")(*args(4, 96, 16)))  # K = 96
    with pytest.raises(Exception, match="act_format"):
        jax.block_until_ready(_raw_call(4, 128, 16, "int8")(*args(4, 128, 16)))
    with pytest.raises(Exception, match="last dim 128"):  # the old two-values-per-byte q
        jax.block_until_ready(_raw_call(4, 128, 16, "int4", q_last=64)(*args(4, 128, 16)))
    with pytest.raises(Exception, match="num_sms"):
        jax.block_until_ready(_raw_call(4, 128, 16, "int4", num_sms=0)(*args(4, 128, 16)))
    needed = budget.act_quant_launch(1, 8192, 32, num_sms=_library.cuda_sm_count()).workspace_bytes
    assert needed > 0
    with pytest.raises(Exception, match="workspace"):  # a K split needs its LA partials
        jax.block_until_ready(_raw_call(1, 8192, 32, "int4", workspace_bytes=needed - 16)(*args(1, 8192, 32)))
