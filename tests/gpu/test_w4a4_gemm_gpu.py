"""w4a4_gemm on the GPU through the warp-specialized sm90 kernel (csrc/kernels/sm90/w4a4_gemm.cu).

The activations come from ``reference.act_quant`` on random X, the weights from
``formats.svdq.quantize_weights`` then ``formats.svdq_layout.prepack`` / ``prepack_scales`` (the kernel
layouts); the reference
``jax_w4a4.reference.w4a4_gemm`` runs on the CPU backend on the very same quantized arrays (logical
weights), so a failure here is the GEMM's. The cases cover every token tile (8 to 64: one CTA; 128:
clusters of 2 with the multicast token operand; for long prefills on weights expanded to e4m3 before the
GEMM, as 128- and 256-token tiles), masked token tails (a tile partly past M; a cluster's
second half wholly past M), the phantom column tile of an odd tile count, several tiles per persistent
CTA, decode launches dealt over the CTAs by stream-K (tiles cut over up to ~6 CTAs whose partials the
finishing CTA adds: M = 1, 7, 13, 16, 20, 40, 64 on ~132 SMs, see W4A4UsesStreamK), long K
(the stage ring wraps many times), low-rank chunks (none, partial, several per tile), α/β present or
absent, bf16 and fp16, and the three activation formats. Checks: every element finite (the output memory
is poisoned with NaN before the run: a freed NaN buffer of the same size, which XLA's allocator hands out
again), relative Frobenius error below the bound, and the data are such that dropping the low-rank term
or α/β would fail that bound.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import jax_w4a4
from jax_w4a4 import budget, ops, reference
from jax_w4a4.formats import svdq, svdq_layout
from jax_w4a4.ops import _library
from jax_w4a4.sharding import shard_weights

pytestmark = pytest.mark.gpu

BF16, F16 = jnp.bfloat16, jnp.float16
TOLERANCE = {BF16: 4e-3, F16: 1.5e-3}  # relative Frobenius error
ROWS_CHECKED = 128  # rows compared against the CPU reference when M is large (all rows are checked finite)

# (M, N, K, rank, α/β, dtype, act_format): M in {1, 7, 64, 333, 4096} plus tile-edge M's, every (N, K) of
# the brief, ranks {0, 16, 32, 128}; one act_format per case, all three formats over the list.
CASES = [
    (1, 3072, 3072, 16, True, BF16, "int4"),         # 8-token tile, partial low-rank chunk
    (7, 14336, 4096, 0, False, BF16, "fp8"),         # 8-token tile, masked tail, no low rank, no α/β
    (7, 128, 128, 16, True, F16, "uint4"),           # smallest shape: one K stage, one column tile
    (13, 4096, 4096, 32, True, BF16, "fp8"),         # 16-token tile, masked tail
    (16, 3072, 3072, 16, False, F16, "int4"),        # 16-token tile, full
    (9, 128, 128, 0, True, BF16, "uint4"),           # 16-token tile, one K stage, no low rank
    (20, 28672, 1024, 32, True, F16, "int4"),        # 32-token tile, 224 column tiles: 2 per CTA
    (40, 4096, 4096, 128, False, BF16, "uint4"),     # 64-token tile, stream-K, partly past M
    (64, 12288, 3072, 32, True, F16, "fp8"),         # 64-token tile, full, stream-K
    (64, 128, 128, 0, True, BF16, "int4"),           # 64-token tile, one column tile, one K stage
    (150, 3072, 3072, 16, True, BF16, "fp8"),        # 128-token tile: last tile's second half wholly past M
    (333, 4096, 4096, 128, True, F16, "int4"),       # 128-token tile, 3 token tiles, 4 low-rank chunks
    (333, 128, 128, 32, False, F16, "fp8"),          # 128-token tile with a phantom column tile
    # Long prefills: weights expanded to e4m3 before the GEMM (from 768 tokens), on the 128-token tile or, for int4 /
    # uint4 activations where its rounds over ~132 SMs are no more work, the 256-token one (budget.w4a4_launch_tile;
    # the tiles below are those planned for 132 SMs).
    (1100, 1536, 2048, 16, True, F16, "int4"),       # 128 tokens, expanded weights, masked token tail
    (4096, 14336, 4096, 128, True, BF16, "fp8"),     # 128 tokens (fp8), expanded weights, wide N
    (800, 3072, 2048, 32, True, BF16, "int4"),       # 256 tokens: last tile's second half past M; 2 low-rank chunks
    (1000, 4096, 1024, 16, False, F16, "uint4"),     # 256 tokens: last tile's second half partly past M
    (4096, 896, 1024, 16, True, BF16, "uint4"),      # 256 tokens: a phantom column tile
    (4096, 3072, 12288, 32, False, F16, "uint4"),    # 256 tokens: long K, 192 cluster tiles (~3 per CTA)
    (4096, 4096, 4096, 128, True, BF16, "int4"),     # 256 tokens: 8 low-rank chunks of 16 ranks
    (4096, 4096, 4096, 0, True, F16, "int4"),        # 256 tokens: rank 0 with α/β
]


def _case_id(case):
    m, n, k, rank, affine, dtype, fmt = case
    return f"{jnp.dtype(dtype).name}-{fmt}-M{m}-N{n}-K{k}-r{rank}{'-affine' if affine else ''}"


@functools.partial(jax.jit, static_argnames=("m", "n", "k", "rank", "dtype", "act_format"))
def _make_inputs(key, *, m, n, k, rank, dtype, act_format):
    """Random X, smoothing, low-rank factors, weights; X quantized by the reference act_quant (so a
    failure here is the GEMM's)."""
    kx, ks, kd, ku, kw, ka, kb = jax.random.split(key, 7)
    x = jax.random.normal(kx, (m, k), jnp.float32)
    if act_format == "uint4":
        x = jnp.abs(x)  # the unsigned format is for non-negative activations
    x = x.astype(dtype)
    smooth = jax.random.uniform(ks, (k,), jnp.float32, 0.5, 2.0)
    lora_down = (jax.random.normal(kd, (k, rank)) / np.sqrt(k)).astype(dtype)
    # Scaled so the low-rank term is about half the main product: both must be right to pass.
    lora_up = (jax.random.normal(ku, (rank, n)) * (0.7 / np.sqrt(max(rank, 1)))).astype(dtype)
    w = jax.random.normal(kw, (n, k)) * (1.0 / np.sqrt(k))
    qweight, wscales = svdq.quantize_weights(w, scale_dtype=dtype)
    q_x, s_x, la = reference.act_quant(x, smooth, lora_down, act_format=act_format)
    alpha = jax.random.uniform(ka, (n,), jnp.float32, 0.5, 1.5)
    bias = jax.random.normal(kb, (n,)).astype(dtype)
    return q_x, s_x, la, qweight, wscales, lora_up, alpha, bias


def _poison_output_memory(shape, dtype):
    """Fill a buffer of the output's size with NaN and free it: XLA's allocator reuses it for the output."""
    jnp.full(shape, jnp.nan, dtype).block_until_ready()


def _relative_error(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def _kernel_layouts(qweight, wscales):
    """The logical weights and scales in the layouts the kernel reads (formats.svdq_layout)."""
    return svdq_layout.prepack(qweight), svdq_layout.prepack_scales(wscales)


def _cpu_reference(q_x, s_x, la, qweight, wscales, lora_up, alpha, bias, act_format):
    cpu = jax.devices("cpu")[0]
    args = jax.device_put((q_x, s_x, la, qweight, wscales, lora_up, alpha, bias), cpu)
    fn = jax.jit(functools.partial(reference.w4a4_gemm, act_format=act_format))  # runs where the args are
    return np.asarray(fn(*args), np.float32)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_w4a4_gemm_sm90_matches_reference(case):
    m, n, k, rank, affine, dtype, act_format = case
    key = jax.random.key(zlib.crc32(_case_id(case).encode()))
    q_x, s_x, la, qweight, wscales, lora_up, alpha, bias = _make_inputs(
        key, m=m, n=n, k=k, rank=rank, dtype=dtype, act_format=act_format)
    alpha, bias = (alpha, bias) if affine else (None, None)
    args = (q_x, s_x, la, *_kernel_layouts(qweight, wscales), lora_up, alpha, bias)
    gemm = jax.jit(functools.partial(ops.w4a4_gemm, act_format=act_format)).lower(*args).compile()

    _poison_output_memory((m, n), dtype)
    y = np.asarray(jax.block_until_ready(gemm(*args)), np.float32)
    assert y.shape == (m, n)
    assert np.isfinite(y).all(), f"{np.sum(~np.isfinite(y))} of {y.size} outputs not finite (unwritten?)"

    # Rows are independent: the first and last rows (the token tails) and a random spread when M is large.
    rows = np.arange(m) if m <= 400 else np.unique(np.concatenate(
        [[0, m - 1], np.random.default_rng(m).choice(m, ROWS_CHECKED - 2, replace=False)]))
    ref = _cpu_reference(q_x[rows], s_x[rows], la[rows], qweight, wscales, lora_up, alpha, bias, act_format)
    got = y[rows]
    tol = TOLERANCE[dtype]
    err = _relative_error(got, ref)
    assert err < tol, f"relative Frobenius error {err:.2e} >= {tol:.1e}"
    row_err = np.linalg.norm(got - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)
    assert row_err.max() < 4 * tol, f"row {rows[np.argmax(row_err)]}: relative error {row_err.max():.2e}"

    # The bound can fail: dropping the low-rank term or α/β moves the result far more than the tolerance.
    ref64 = ref.astype(np.float64)
    lowrank = np.zeros_like(ref64)
    if rank > 0:
        la_rounded = np.asarray(la[rows].astype(dtype), np.float64)
        lowrank = la_rounded @ np.asarray(lora_up, np.float64)
        assert np.linalg.norm(lowrank) > 10 * tol * np.linalg.norm(ref64)
    if affine:
        beta = np.asarray(bias, np.float64)
        alpha64 = np.asarray(alpha, np.float64)
        main = (ref64 - lowrank - beta) / alpha64
        assert np.linalg.norm((alpha64 - 1) * main + beta) > 10 * tol * np.linalg.norm(ref64)


def test_stream_k_flags_are_rearmed():
    """Nothing zeroes the stream-K flags before a launch (csrc/common/arrival_counters.h): each launch must
    leave them at 0 (a flag left set lets a finisher add a partial before it is written). The same call
    sites run on new data each time and match the reference; then every counter reads back 0."""
    for seed in range(3):
        for m in (1, 16, 20, 64):  # the 8-, 16-, 32- and 64-token tiles, all stream-K at 8192 x 8192
            assert budget.w4a4_workspace_bytes(m, 8192, 8192, num_sms=_library.cuda_sm_count()) > 0
            q_x, s_x, la, qweight, wscales, lora_up, alpha, bias = _make_inputs(
                jax.random.key(100 * seed + m), m=m, n=8192, k=8192, rank=32, dtype=BF16, act_format="int4")
            gemm = jax.jit(functools.partial(ops.w4a4_gemm, act_format="int4"))
            _poison_output_memory((m, 8192), BF16)
            y = np.asarray(gemm(q_x, s_x, la, *_kernel_layouts(qweight, wscales), lora_up, alpha, bias), np.float32)
            ref = _cpu_reference(q_x, s_x, la, qweight, wscales, lora_up, alpha, bias, "int4")
            assert np.isfinite(y).all() and _relative_error(y, ref) < TOLERANCE[BF16], (seed, m)
    assert _library.armed_arrival_counters() == 0


@pytest.mark.parametrize("m", [333, 13])
def test_w4a4_gemm_sm90_is_deterministic(m):
    """Fixed accumulation order (prefill: whole tiles; decode: stream-K partials added in CTA order):
    repeated runs are bitwise equal."""
    q_x, s_x, la, qweight, wscales, lora_up, alpha, bias = _make_inputs(
        jax.random.key(11), m=m, n=3072, k=4096, rank=32, dtype=BF16, act_format="int4")
    gemm = jax.jit(functools.partial(ops.w4a4_gemm, act_format="int4"))
    args = (q_x, s_x, la, *_kernel_layouts(qweight, wscales), lora_up, alpha, bias)
    first = np.asarray(gemm(*args))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(gemm(*args)), first)


def _first_tokens_of_tile(n: int, tile_m: int, sms: int, act_format: str) -> int:
    """The fewest tokens from the expanded-weights threshold whose launch runs the `tile_m` tile on expanded weights."""
    first = budget.w4a4_expanded_weights_min_tokens()
    return next(m for m in range(first, 8 * first)
                if budget.w4a4_launch_tile(m, n, num_sms=sms, act_format=act_format).tile_m == tile_m)


@pytest.mark.parametrize("pair, act_format, dtype", [("registers-expanded", "int4", BF16),
                                                     ("registers-expanded", "fp8", F16),
                                                     ("expanded-256", "int4", BF16), ("expanded-256", "uint4", F16)])
def test_expanded_weights_give_the_register_path_bits(pair, act_format, dtype):
    """From w4a4_expanded_weights_min_tokens the prefill tile reads e4m3 weights expanded into the workspace
    before the GEMM (w4a4_gemm_plan.h); below, it converts them in registers; past the threshold the launch may take
    the 256-token tile on expanded weights instead (int4 / uint4: budget.w4a4_launch_tile). All feed the same e4m3
    values to the same wgmmas in the same order, so the first m - 1 rows of an m-token call equal an (m - 1)-token
    call's bit for bit across each change of instance (with one low-rank chunk: the 256-token tile's chunks are 16
    ranks, the 128-token tile's 32, so the two sum a 32-rank term in different orders; and the rows match the
    reference in the CASES above)."""
    sms = _library.cuda_sm_count()
    n, k = 8192, 1024
    if pair == "registers-expanded":
        m = budget.w4a4_expanded_weights_min_tokens()
        assert budget.w4a4_launch_tile(m - 1, n, num_sms=sms, act_format=act_format).expanded_weights is False
        assert budget.w4a4_launch_tile(m, n, num_sms=sms, act_format=act_format).expanded_weights is True
    else:
        m = _first_tokens_of_tile(n, 256, sms, act_format)
        narrower_tile = budget.w4a4_launch_tile(m - 1, n, num_sms=sms, act_format=act_format)
        assert narrower_tile == budget.W4A4LaunchTile(128, 2, True)
    q_x, s_x, la, qweight, wscales, lora_up, alpha, bias = _make_inputs(
        jax.random.key(23), m=m, n=n, k=k, rank=16, dtype=dtype, act_format=act_format)
    gemm = jax.jit(functools.partial(ops.w4a4_gemm, act_format=act_format))
    weights = (*_kernel_layouts(qweight, wscales), lora_up, alpha, bias)
    _poison_output_memory((m, n), dtype)
    wider = np.asarray(gemm(q_x, s_x, la, *weights))
    _poison_output_memory((m - 1, n), dtype)
    narrower = np.asarray(gemm(q_x[: m - 1], s_x[: m - 1], la[: m - 1], *weights))
    assert np.isfinite(wider.astype(np.float32)).all()
    np.testing.assert_array_equal(wider[: m - 1].view(np.uint16), narrower.view(np.uint16))
    ref = _cpu_reference(q_x[-2:], s_x[-2:], la[-2:], qweight, wscales, lora_up, alpha, bias, act_format)
    assert _relative_error(wider[-2:].astype(np.float32), ref) < TOLERANCE[dtype]


# (M, N, K, rank, dtype, act_format) of the fused linear: every token tile, stream-K and whole tiles, the
# expanded-weights prefill on 128- and 256-token tiles (its GEMM is not launched early), ranks 0 / 32 / 128, every
# activation format.
LINEAR_CASES = [
    (1, 28672, 8192, 32, BF16, "int4"),
    (7, 3072, 1536, 128, F16, "fp8"),
    (16, 8192, 8192, 32, BF16, "uint4"),
    (16, 128, 256, 0, BF16, "int4"),
    (20, 4096, 2048, 32, F16, "fp8"),  # 32-token tile: act_quant's promotion records against the GEMM's own
    (33, 4096, 4096, 32, F16, "int4"),
    (64, 12288, 3072, 128, BF16, "fp8"),
    (200, 3072, 3072, 32, BF16, "int4"),
    (1100, 1536, 2048, 16, F16, "uint4"),
    (1000, 4096, 1024, 32, BF16, "int4"),  # the 256-token tile (planned for ~132 SMs)
]


def _check_linear_equals_the_two_ops(case):
    """ops.w4a4_linear's output equals act_quant's kernel then the GEMM's run as separate executables (nothing
    overlaps), bit for bit: alone, and as a chain of three layers in one jit (where XLA records a command
    buffer), with the output memory poisoned before each run and every counter re-armed after. Returns the
    first layer's act_quant outputs, the two ops' result and the logical weights."""
    m, n, k, rank, dtype, act_format = case
    key = jax.random.key(zlib.crc32(f"linear-{case}".encode()))
    _, _, _, qweight, wscales, lora_up, alpha, bias = _make_inputs(
        key, m=1, n=n, k=k, rank=rank, dtype=dtype, act_format=act_format)
    kx, ks, kd = jax.random.split(jax.random.fold_in(key, 1), 3)
    xs = jax.random.normal(kx, (3, m, k), jnp.float32)
    xs = (jnp.abs(xs) if act_format == "uint4" else xs).astype(dtype)
    smooth = jax.random.uniform(ks, (k,), jnp.float32, 0.5, 2.0)
    lora_down = (jax.random.normal(kd, (k, rank)) / np.sqrt(k)).astype(dtype)
    weights = (*_kernel_layouts(qweight, wscales), lora_up, alpha, bias)
    quantize = jax.jit(functools.partial(ops.act_quant, act_format=act_format))
    gemm = jax.jit(functools.partial(ops.w4a4_gemm, act_format=act_format))
    quantized = [jax.block_until_ready(quantize(x, smooth, lora_down)) for x in xs]
    apart = [np.asarray(gemm(*acts, *weights)) for acts in quantized]
    linear = functools.partial(ops.w4a4_linear, act_format=act_format)
    one = jax.jit(linear)
    chain = jax.jit(lambda xs: [linear(x, smooth, lora_down, *weights) for x in xs])
    for _ in range(2):
        _poison_output_memory((m, n), dtype)
        np.testing.assert_array_equal(np.asarray(one(xs[0], smooth, lora_down, *weights)), apart[0])
        _poison_output_memory((3, m, n), dtype)
        for got, want in zip(chain(xs), apart):
            np.testing.assert_array_equal(np.asarray(got), want)
    assert np.isfinite(apart[0].astype(np.float32)).all()
    assert _library.armed_arrival_counters() == 0
    return quantized[0], apart[0], (qweight, wscales, lora_up, alpha, bias)


@pytest.mark.parametrize("case", LINEAR_CASES, ids=[_case_id((*c[:4], False, *c[4:])) for c in LINEAR_CASES])
def test_w4a4_linear_overlapped_equals_the_two_ops_apart(case):
    """ops.w4a4_linear launches act_quant and the GEMM in one FFI call, the GEMM with programmatic dependent
    launch: it starts while act_quant runs and must wait for act_quant's outputs before it reads them."""
    _check_linear_equals_the_two_ops(case)


@pytest.mark.parametrize("style", ["column", "row"])
def test_w4a4_tensor_parallel_shard_on_one_device(style):
    """A tensor-parallel shard's code on the GPU (shard_weights: a shard_map over a 1-device "tensor" axis; the
    automatic path runs the same per-device code): a column shard is the unsharded layer bit for bit; a row
    shard runs the one-call linear without β, sums it over the axis in fp32 and adds β once."""
    key_w, key_b, key_x = jax.random.split(jax.random.key(zlib.crc32(f"tensor-parallel-{style}".encode())), 3)
    n, k = 1024, 2048
    w = jax.random.normal(key_w, (n, k), jnp.float32) / np.sqrt(k)
    bias = jax.random.normal(key_b, (n,), jnp.float32)
    weights = jax_w4a4.quantize_linear(w, bias, mode="svdq-int4", rank=32)
    x = jax.random.normal(key_x, (16, k), BF16)
    mesh = jax.make_mesh((1,), ("tensor",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    placed = shard_weights(weights, mesh, style=style)
    if style == "column":
        want = np.asarray(jax.jit(jax_w4a4.linear)(x, weights))
    else:
        partial = jax.jit(jax_w4a4.linear)(x, dataclasses.replace(weights, bias=None))
        want = np.asarray((partial.astype(jnp.float32) + weights.bias.astype(jnp.float32)).astype(BF16))
    _poison_output_memory((16, n), BF16)
    got = np.asarray(jax.jit(jax_w4a4.linear)(x, placed))
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got.astype(np.float32)).all()


def test_w4a4_linear_planned_for_few_sms(monkeypatch):
    """On 16 SMs (an H100 MIG 1g slice) act_quant plans 64-row blocks for 16 tokens at rank 128, which do not
    write the GEMM's promotion records: the GEMM forms them in a kernel after act_quant, and the linear must not
    hand the tokens over before that kernel ends. Planned for 16 SMs on the whole GPU (only the grids change):
    the linear equals the two ops bit for bit, and they match the reference."""
    monkeypatch.setattr(_library, "cuda_sm_count", lambda: 16)
    assert budget.act_quant_launch(16, 4096, 128, num_sms=16).block_rows == 64  # the path under test
    (q_x, s_x, la), y, weights = _check_linear_equals_the_two_ops((16, 1024, 4096, 128, BF16, "int4"))
    ref = _cpu_reference(q_x, s_x, la, *weights, "int4")
    err = _relative_error(y.astype(np.float32), ref)
    assert err < TOLERANCE[BF16], f"relative Frobenius error {err:.2e}"
