"""Sharded quantized linears on 8 fake CPU devices: the explicit path (``shard_weights``, shard_map),
the automatic one (weights placed by hand with NamedSharding under plain jit: custom_partitioning
with Shardy rules), ``shard_model`` and the sharded Llama decoder."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.errors import JaxRuntimeError
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jax_w4a4 import linear, ops, quantize_fp4, quantize_linear
from jax_w4a4.formats import svdq_layout, w4a16_layout
from jax_w4a4.models import llama
from jax_w4a4.nn import QuantizedLinear
from jax_w4a4.nn.linear import linear_weights
from jax_w4a4.nn.model import replace_at
from jax_w4a4.sharding import ROW_PARALLEL_ALL_REDUCES, TensorParallelWeights, shard_model, shard_weights
from jax_w4a4.weights import SVDQuantWeights

N, K = 512, 1024  # the smallest layer that every mode can split 8 ways on N (64-row blocks) and K (fp8 groups)
MODES = ("svdq-int4", "w4a8", "w4a16")
BF16_EPS = 2.0**-7  # one bf16 ulp is at most this, relative (8-bit significand)


@functools.cache
def _weights(mode: str):
    """One (N, K) layer per mode, with bias; svdq with α. w4a8 is the svdq-int4 layer with fp8
    activations (quantize_linear makes the same weights for both; this skips a second quantization)."""
    if mode == "w4a8":
        return dataclasses.replace(_weights("svdq-int4"), act_format="fp8")
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((N, K)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(N), jnp.float32)
    weights = quantize_linear(w, bias, mode=mode, rank=32, group_size=128)
    if mode == "svdq-int4":  # exercise α (it distributes over the row-parallel sum)
        weights = dataclasses.replace(weights, alpha=jnp.asarray(rng.uniform(0.5, 1.5, N), jnp.float32))
    return weights


def _mesh(shape):
    names = ("tensor",) if len(shape) == 1 else ("data", "tensor")
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _slice_k(weights, lo: int, hi: int):
    """The K-slice [lo, hi) of the global weights as an unsharded layer without bias (svdq: its rows of L_down,
    all of L_up: a shard's share of the low-rank branch)."""
    n, k = weights.out_features, weights.in_features
    if isinstance(weights, SVDQuantWeights):
        logical = svdq_layout.unprepack(weights.qweight, n, k)[:, lo // 2 : hi // 2]
        return dataclasses.replace(
            weights, qweight=svdq_layout.prepack(logical), wscales=weights.wscales[lo // 128 : hi // 128],
            smooth=weights.smooth[lo:hi], lora_down=weights.lora_down[lo:hi], bias=None,
        )
    g = weights.group_size
    logical = w4a16_layout.unprepack(weights.qweight, n, k)[:, lo // 2 : hi // 2]
    return dataclasses.replace(
        weights, qweight=w4a16_layout.prepack(logical), scales=weights.scales[lo // g : hi // g],
        zeros=None if weights.zeros is None else weights.zeros[lo // g : hi // g], bias=None,
    )


def _row_expected(x, weights, shards):
    """Independent row-parallel math: per-slice unsharded layers without bias, fp32 sum, bias once.

    Returns (expected output fp32, the magnitude that bounds rounding differences: Σ_s |partial_s|,
    plus 2 Σ_s |LA_s|·|L_up| for svdq)."""
    step = weights.in_features // shards
    slices = [(x[..., s * step : (s + 1) * step], _slice_k(weights, s * step, (s + 1) * step)) for s in range(shards)]
    partials = [linear(x_s, w_s).astype(jnp.float32) for x_s, w_s in slices]
    acc, mass = sum(partials), sum(jnp.abs(p) for p in partials)
    if isinstance(weights, SVDQuantWeights):
        # Each LA_s is rounded to bf16 (for its product with L_up) after an fp32 sum whose order may flip that
        # rounding: 1 ulp of LA_s; the unsharded layer rounds LA itself, |LA| <= Σ_s |LA_s|.
        lora_up = jnp.abs(weights.lora_up.astype(jnp.float32))
        mass = mass + 2 * sum(jnp.abs(x_s.astype(jnp.float32) @ w_s.lora_down.astype(jnp.float32)) @ lora_up
                              for x_s, w_s in slices)
    if weights.bias is not None:
        acc = acc + weights.bias.astype(jnp.float32)
    return acc.astype(weights.dtype).astype(jnp.float32), mass


def _check_row(y, want, expected, partial_mass, err_msg=""):
    y = np.asarray(y, np.float32)
    # Equal to the independent per-shard math up to fp32 summation order (one final rounding flip).
    np.testing.assert_array_less(
        np.abs(y - expected), BF16_EPS * (np.abs(expected) + partial_mass / 2**8) + 1e-6, err_msg=err_msg
    )
    # Versus the unsharded layer: each partial is rounded to bf16 once (half an ulp each) + output ulp.
    np.testing.assert_array_less(
        np.abs(y - want), BF16_EPS / 2 * partial_mass + BF16_EPS * np.abs(want) + 1e-6, err_msg=err_msg
    )


def _weight_gathers(hlo: str, placed) -> list[str]:
    """all-gathers whose result has a weight array's global or local dims, or a packed-weight dtype."""
    dims = {",".join(map(str, a.shape)) for a in jax.tree.leaves(placed)}
    dims |= {",".join(map(str, s.data.shape)) for a in jax.tree.leaves(placed) for s in a.addressable_shards[:1]}
    lines = [line for line in hlo.splitlines() if "all-gather(" in line]
    return [line for line in lines if any(f"[{d}]" in line.split("all-gather(")[0] for d in dims)
            or "u8[" in line or "s32[" in line]


def _by_hand(weights, mesh, style: str, axis: str = "tensor", put=jax.device_put):
    """The global arrays placed with NamedSharding, as a user would: the automatic path.

    Column: every N axis sharded; row: every K axis. w4a16: qweight's rows (N/16 blocks + the
    permutation row) have no even N sharding, so they stay replicated (row: its word axis is split)."""
    col = style == "column"
    on_n, on_k = (P(axis), P()) if col else (P(), P(None, axis))
    if isinstance(weights, SVDQuantWeights):
        specs = dict(qweight=on_n if col else on_k, wscales=P(None, axis) if col else P(axis), smooth=P() if col else P(axis),
                     lora_down=P() if col else P(axis), lora_up=P(None, axis) if col else P(), alpha=on_n, bias=on_n)
    else:
        scales = P(None, axis) if col else P(axis)  # (K/G, N)
        specs = dict(qweight=P() if col else on_k, scales=scales, zeros=scales, g_idx=P(), bias=on_n)
    return dataclasses.replace(weights, **{
        name: put(getattr(weights, name), NamedSharding(mesh, spec))
        for name, spec in specs.items() if getattr(weights, name) is not None
    })


PATHS = {  # weights -> placed weights, for each path
    "explicit": lambda weights, mesh, style: shard_weights(weights, mesh, style=style),
    "automatic": _by_hand,
}


# ------------------------------------------------------------------------------------ one layer


@pytest.mark.parametrize("mesh_shape, batch", [((8,), 5), ((2, 4), 4), ((2, 4), 3)])
@pytest.mark.parametrize("mode", MODES)
def test_matches_unsharded(mode, mesh_shape, batch, rng):
    # One program per path: a column and a row layer side by side, on x batch-sharded over "data"
    # (2-D meshes; 3 rows do not divide it and are padded by XLA).
    mesh = _mesh(mesh_shape)
    weights = _weights(mode)
    x = jnp.asarray(rng.standard_normal((batch, K)), jnp.bfloat16)
    data = NamedSharding(mesh, P("data")) if len(mesh_shape) == 2 else None
    even = data is None or batch % mesh.shape["data"] == 0
    if data is not None and even:
        x = jax.device_put(x, data)

    def f(x_column, x_row, column, row):
        if data is not None:
            x_column, x_row = (jax.lax.with_sharding_constraint(v, data) for v in (x_column, x_row))
        return linear(x_column, column), linear(x_row, row)

    want = np.asarray(linear(x, weights).astype(jnp.float32))
    expected, partial_mass = _row_expected(x, weights, mesh.shape["tensor"])
    for path, place in PATHS.items():
        column, row = place(weights, mesh, "column"), place(weights, mesh, "row")
        compiled = jax.jit(f).lower(x, x, column, row).compile()
        (y_column, y_row), hlo = compiled(x, x, column, row), compiled.as_text()
        if even:
            assert "all-gather" not in hlo, path
            assert y_column.sharding.spec[-1] == "tensor", path  # the column output stays sharded on N
        else:  # the padded rows of x or y may be gathered; weights never
            assert _weight_gathers(hlo, (column, row)) == [], path
        assert hlo.count("all-reduce(") == ROW_PARALLEL_ALL_REDUCES, path  # the row layer's; columns have none
        # Each column shard runs the unsharded layer on its columns.
        np.testing.assert_array_equal(np.asarray(y_column.astype(jnp.float32)), want, err_msg=path)
        _check_row(y_row, want, expected, partial_mass, err_msg=path)


def test_explicit_mesh_and_rank0(rng):
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    w = jnp.asarray(rng.standard_normal((N, K)), jnp.float32)
    weights = quantize_linear(w, None, mode="svdq-int4", rank=0)
    tp = shard_weights(weights, mesh, style="row")
    x = jax.device_put(jnp.asarray(rng.standard_normal((4, K)), jnp.bfloat16), NamedSharding(mesh, P("data", None)))
    compiled = jax.jit(linear).lower(x, tp).compile()
    y, hlo = compiled(x, tp), compiled.as_text()
    assert "all-gather" not in hlo and hlo.count("all-reduce(") == ROW_PARALLEL_ALL_REDUCES
    expected, partial_mass = _row_expected(x, weights, 4)
    np.testing.assert_array_less(
        np.abs(np.asarray(y, np.float32) - expected), BF16_EPS * (np.abs(expected) + partial_mass / 2**8) + 1e-6
    )


def test_row_parallel_layer_with_padded_outputs(rng):
    # N = 192 is stored padded to the kernel's 256 rows (SVDQuantWeights.out_padding): both paths
    # return the 192 logical outputs.
    weights = quantize_linear(jnp.asarray(rng.standard_normal((192, 512)), jnp.float32), mode="svdq-int4", rank=16)
    assert weights.out_padding == 64
    mesh = _mesh((2, 4))
    x = jnp.asarray(rng.standard_normal((4, 512)), jnp.bfloat16)
    want = np.asarray(linear(x, weights).astype(jnp.float32))
    for path, place in PATHS.items():
        y = np.asarray(jax.jit(linear)(x, place(weights, mesh, "row")).astype(jnp.float32))
        assert y.shape == (4, 192), path
        np.testing.assert_allclose(y, want, rtol=0, atol=4 * BF16_EPS * np.abs(want).max(), err_msg=path)


def test_w4a16_act_order(rng):
    n, k = 128, 512
    w = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
    g_idx = jnp.asarray(rng.permutation(np.arange(k) // 128), jnp.int32)
    weights = jax.jit(functools.partial(quantize_linear, mode="w4a16", group_size=128))(w, None, g_idx=g_idx)
    mesh = _mesh((8,))
    x = jnp.asarray(rng.standard_normal((3, k)), jnp.bfloat16)
    want = np.asarray(linear(x, weights).astype(jnp.float32))
    for path, place in PATHS.items():  # column: K is whole, act-order works
        placed = place(weights, mesh, "column")
        compiled = jax.jit(linear).lower(x, placed).compile()
        assert "all-gather" not in compiled.as_text(), path
        np.testing.assert_array_equal(np.asarray(compiled(x, placed).astype(jnp.float32)), want, err_msg=path)
    with pytest.raises(ValueError, match="act-order"):
        shard_weights(weights, mesh, style="row")
    with pytest.raises(JaxRuntimeError, match="act-order"):  # found when the program is compiled
        jax.jit(linear).lower(x, _by_hand(weights, _mesh((2, 4)), "row")).compile()


def _abstract(mode: str, n: int, k: int, **options):
    """Shapes-only weights (``jax.eval_shape``): enough for the checks, nothing is quantized."""
    return jax.eval_shape(functools.partial(quantize_linear, mode=mode, rank=0, **options), jnp.ones((n, k)))


@pytest.mark.parametrize(
    "mode, n, k, style, match",
    [
        ("svdq-int4", 448, 512, "column", r"N \(out_features\) must be a multiple of 512"),
        ("w4a8", 512, 512, "row", r"K \(in_features\) must be a multiple of 1024"),
        ("svdq-int4", 512, 256, "row", r"K \(in_features\) must be a multiple of 1024"),
        ("w4a16", 64, 512, "column", r"N \(out_features\) must be a multiple of 128"),
        ("w4a16", 512, 512, "row", r"K \(in_features\) must be a multiple of 1024"),
    ],
)
def test_misalignment_is_a_value_error(mode, n, k, style, match):
    with pytest.raises(ValueError, match=match):
        shard_weights(_abstract(mode, n, k, group_size=128), _mesh((8,)), style=style)


def test_bad_arguments():
    weights = _abstract("w4a16", N, K)
    with pytest.raises(ValueError, match="style"):
        shard_weights(weights, _mesh((8,)), style="diagonal")
    with pytest.raises(ValueError, match="axis"):
        shard_weights(weights, _mesh((8,)), axis="model")


def test_automatic_unsupported_placements_fail_at_compile_time():
    # The partition callbacks raise a ValueError naming the dimension (JAX reports it from compile).
    mesh = _mesh((8,))

    def abstract_put(a, sharding):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    fp8_row = _by_hand(_abstract("w4a8", 512, 512), mesh, "row", put=abstract_put)
    # The prepacked scales' 4 K-stages cannot be split 8 ways at all (JAX refuses that placement itself):
    # replicated, so that qweight's K split is what fails.
    fp8_row = dataclasses.replace(fp8_row, wscales=abstract_put(fp8_row.wscales, NamedSharding(mesh, P())))
    per_channel = _abstract("w4a16", 128, 512, group_size=-1)
    per_channel_row = dataclasses.replace(  # its one scale column cannot be split: only qweight's words are
        per_channel, qweight=abstract_put(per_channel.qweight, NamedSharding(mesh, P(None, "tensor")))
    )
    x = jax.ShapeDtypeStruct((2, 512), jnp.bfloat16)
    cases = [
        (linear, (x, fp8_row), r"w4a4_linear .*K \(in_features\) must be a multiple of 1024 \(128-column stages"),
        (linear, (x, per_channel_row), "per-channel"),
        # act_quant on its own: its 4 fp8 groups of K cannot be split over the 8 shards of smooth / lora_down.
        (functools.partial(ops.act_quant, act_format="fp8"), (x, fp8_row.smooth, fp8_row.lora_down),
         r"act_quant .*K must be a multiple of 1024 \(128-wide fp8"),
    ]
    for function, args, match in cases:
        with pytest.raises(JaxRuntimeError, match=match):
            jax.jit(function).lower(*args).compile()


@pytest.mark.parametrize("mode", ["svdq-int4", "w4a8"])
@pytest.mark.parametrize("style", ["column", "row"])
def test_w4a4_layer_runs_as_one_op_per_shard(mode, style):
    # Automatic: the W4A4 layer partitions as one op of all 8 operands. Every shard runs the whole layer on its
    # slice (the one-call linear on the GPU: act_quant and the GEMM in one FFI call), row shards without β:
    # their only all-reduce is the (tokens, N) fp32 output, no LA beside it.
    mesh = _mesh((8,))
    x = jax.ShapeDtypeStruct((4, K), jnp.bfloat16)
    for path, place in PATHS.items():
        lowered = jax.jit(linear).lower(x, place(_weights(mode), mesh, style))
        if path == "automatic":
            calls = [line for line in lowered.as_text().splitlines() if "@CustomSPMDPartitioning(" in line]
            assert len(calls) == 1 and calls[0].count("%arg") == 8, calls
        all_reduces = [line for line in lowered.compile().as_text().splitlines() if "all-reduce(" in line]
        if style == "column":
            assert all_reduces == [], path
        else:
            assert len(all_reduces) == ROW_PARALLEL_ALL_REDUCES and re.search(r"= f32\[4,\d+\]\S* all-reduce\(",
                                                                              all_reduces[0]), (path, all_reduces)


@pytest.mark.parametrize("mode", ["svdq-int4", "w4a8"])
def test_automatic_act_quant_and_gemm_alone(mode, rng):
    # The two ops called by themselves partition themselves too: column shards equal the unsharded layer; row
    # shards psum LA and the rank-0 partial product (XLA combines them into one all-reduce), L_up and β once.
    mesh = _mesh((8,))
    weights = _weights(mode)
    x = jnp.asarray(rng.standard_normal((5, K)), jnp.bfloat16)

    def two_ops(x, w):
        activations = ops.act_quant(x, w.smooth, w.lora_down, act_format=w.act_format)
        return ops.w4a4_gemm(*activations, w.qweight, w.wscales, w.lora_up, w.alpha, w.bias, act_format=w.act_format)

    want = np.asarray(linear(x, weights).astype(jnp.float32))
    _, partial_mass = _row_expected(x, weights, mesh.shape["tensor"])
    for style in ("column", "row"):
        compiled = jax.jit(two_ops).lower(x, _by_hand(weights, mesh, style)).compile()
        y = np.asarray(compiled(x, _by_hand(weights, mesh, style)).astype(jnp.float32))
        assert compiled.as_text().count("all-reduce(") == (ROW_PARALLEL_ALL_REDUCES if style == "row" else 0), style
        if style == "column":
            np.testing.assert_array_equal(y, want)
        else:  # half an ulp of every partial and of every |LA_s|·|L_up| (a superset of LA's), one of the output
            np.testing.assert_array_less(np.abs(y - want), BF16_EPS / 2 * partial_mass + BF16_EPS * np.abs(want) + 1e-6)


def test_automatic_under_vmap(rng):
    # The primitives keep their batching rule: vmap inside a jit over placed weights partitions too.
    mesh = _mesh((2, 4))
    weights = _weights("svdq-int4")
    x = jnp.asarray(rng.standard_normal((2, 3, K)), jnp.bfloat16)
    placed = _by_hand(weights, mesh, "column")
    mapped = jax.jit(jax.vmap(linear, in_axes=(0, None)))
    assert "all-gather" not in mapped.lower(x, placed).compile().as_text()
    np.testing.assert_array_equal(np.asarray(mapped(x, placed)), np.asarray(linear(x, weights)))


def test_two_layer_mlp_readme_example(rng):
    # The README "Sharded inference" examples: explicit (shard_weights) and automatic (by hand).
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    w_up = jnp.asarray(rng.standard_normal((1024, 512)), jnp.float32)
    up_q, down_q = quantize_linear(w_up, mode="svdq-int4"), _weights("svdq-int4")  # (1024, 512), (512, 1024)
    up = shard_weights(up_q, mesh, style="column")
    down = shard_weights(down_q, mesh, style="row")
    x = jax.device_put(jnp.asarray(rng.standard_normal((8, 512)), jnp.bfloat16), NamedSharding(mesh, P("data")))

    @jax.jit
    def mlp(x, up, down):  # the README's MLP, also returning its hidden layer: the row layer's input
        hidden = jax.nn.gelu(linear(x, up))
        return hidden, linear(hidden, down)

    def put(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    up_auto = dataclasses.replace(  # column: everything with an N axis sharded on it
        up_q, qweight=put(up_q.qweight, P("tensor")), wscales=put(up_q.wscales, P(None, "tensor")),
        lora_up=put(up_q.lora_up, P(None, "tensor")),
    )
    down_auto = dataclasses.replace(  # row: everything with a K axis sharded on it
        down_q, qweight=put(down_q.qweight, P(None, "tensor")), wscales=put(down_q.wscales, P("tensor")),
        smooth=put(down_q.smooth, P("tensor")), lora_down=put(down_q.lora_down, P("tensor")),
    )
    for path, up_w, down_w in (("explicit", up, down), ("automatic", up_auto, down_auto)):
        # Without excess precision the row layer consumes exactly the bf16 hidden layer it returns.
        compiled = mlp.lower(x, up_w, down_w).compile({"xla_allow_excess_precision": False})
        (hidden, y), hlo = compiled(x, up_w, down_w), compiled.as_text()  # y (8, 512)
        assert "all-gather" not in hlo and hlo.count("all-reduce(") == 1, path  # no weight all-gather
        hidden = jnp.asarray(np.asarray(hidden))  # (make_mesh's axes are Explicit: unshard for the references)
        want = np.asarray(linear(hidden, down_q).astype(jnp.float32))
        _check_row(y, want, *_row_expected(hidden, down_q, 4), err_msg=path)


class _MLP(nnx.Module):
    def __init__(self, up, down):
        self.up = QuantizedLinear(up)
        self.down = QuantizedLinear(down)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def test_shard_model_nnx(rng):
    mesh = _mesh((2, 4))
    up = quantize_linear(jnp.asarray(rng.standard_normal((1024, 512)), jnp.float32), mode="w4a16")
    down = quantize_linear(jnp.asarray(rng.standard_normal((512, 1024)), jnp.float32) / 32, mode="w4a16")
    model = _MLP(up, down)
    x = jnp.asarray(rng.standard_normal((4, 512)), jnp.bfloat16)
    want = np.asarray(model(x).astype(jnp.float32))
    with pytest.warns(UserWarning, match="matching no QuantizedLinear"):
        shard_model(model, mesh, {"up": "column", "down": "row", "lm_head": None})
    assert isinstance(model.up.quantized_weights, TensorParallelWeights)
    assert model.down.quantized_weights.style == "row"
    assert model.up.weights.weights.scales[...].sharding.spec == P(None, "tensor")  # (K/G, N): N sharded
    forward = nnx.jit(lambda m, x: m(x))
    y = np.asarray(forward(model, x).astype(jnp.float32))
    np.testing.assert_allclose(y, want, rtol=0, atol=2 * BF16_EPS * np.abs(want).max())
    assert not np.array_equal(y, np.zeros_like(y))


# ------------------------------------------------------------------------------------ the decoder

# Every projection is (512, 512) (one shape to quantize); llama_mesh picks ("data", "tensor") = (2, 4).
TINY = llama.LlamaConfig(
    vocab_size=256, hidden_size=512, intermediate_size=512, num_layers=1, num_heads=8, num_kv_heads=8,
    head_dim=64, max_positions=64,
)
# Layer -> mode (None: a float nnx.Linear), every placement of shard_llama. The layers whose inputs
# differ after sharding (those after a row layer: the bf16 partials) quantize no activations, so the
# logits stay within a few bf16 ulps (int4 activation codes would turn an ulp into quantization noise).
MODES_BY_LAYER = {
    "q_proj": "svdq-int4", "k_proj": "w4a8", "v_proj": "svdq-int4", "o_proj": "w4a16",
    "gate_proj": "nvfp4", "up_proj": None, "down_proj": "w4a16",
}


def _tiny_llama() -> llama.LlamaModel:
    """A random-weight bf16 decoder with its projections quantized by RTN (MODES_BY_LAYER)."""
    model = llama.LlamaModel(TINY, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    for path, node in list(nnx.iter_graph(model)):
        mode = MODES_BY_LAYER.get(path[-1]) if isinstance(node, nnx.Linear) else None
        if mode is not None:
            w, bias = linear_weights(node)
            weights = quantize_fp4(w, bias) if mode == "nvfp4" else quantize_linear(w, bias, mode=mode, rank=16)
            replace_at(model, path, QuantizedLinear(weights, dtype=jnp.bfloat16))
    return model


_forward = nnx.jit(lambda model, tokens: model(tokens)[0])


def _sharded_logits_and_hlo(model, tokens, mesh):
    """Logits of a jitted forward with the batch sharded on "data", and its compiled HLO."""
    graphdef, state = nnx.split(model)

    def forward(state, tokens):
        tokens = jax.lax.with_sharding_constraint(tokens, NamedSharding(mesh, P("data")))
        return nnx.merge(graphdef, state)(tokens)[0]

    compiled = jax.jit(forward).lower(state, tokens).compile()
    return np.asarray(compiled(state, tokens)), compiled.as_text()


def test_llama_sharded_matches_unsharded(rng):
    tokens = jnp.asarray(rng.integers(0, TINY.vocab_size, (4, 16)), jnp.int32)
    reference = _tiny_llama()
    want = np.asarray(_forward(reference, tokens))
    tolerance = 2**-5 * np.abs(want).max()
    mesh = llama.llama_mesh(TINY)
    assert dict(mesh.shape) == {"data": 2, "tensor": 4}
    model = llama.shard_llama(nnx.clone(reference), mesh)
    mlp = model.layers[0].mlp
    assert isinstance(mlp.down_proj.quantized_weights, TensorParallelWeights)  # svdq / w4a16: shard_weights
    assert model.layers[0].attention.q_proj.quantized_weights.style == "column"
    assert mlp.up_proj.kernel[...].sharding.spec == P(None, "tensor")  # float / fp4: NamedSharding
    assert mlp.gate_proj.weights.packed[...].sharding.spec == P("tensor", None)
    got, hlo = _sharded_logits_and_hlo(model, tokens, mesh)
    # One all-reduce per row layer (o_proj, down_proj), no weight moves: heads and the MLP stay split.
    assert hlo.count("all-reduce(") == 2 * TINY.num_layers and "all-gather" not in hlo
    assert np.abs(got - want).max() < tolerance
    # generate with a mesh (the KV cache sharded on both axes): every greedy token is the unsharded
    # model's argmax up to the tolerance (near-ties may go either way).
    prompt = 10
    new = np.asarray(llama.generate(model, tokens[:, :prompt], 16 - prompt, mesh=mesh))
    following = np.asarray(_forward(reference, jnp.concatenate([tokens[:, :prompt], new], axis=1)))[:, prompt - 1 : -1]
    chosen = np.take_along_axis(following, new[..., None], axis=-1)[..., 0]
    np.testing.assert_array_less(following.max(axis=-1) - chosen, tolerance)
    # perplexity with mesh="auto": one batch of 3 windows on 2 data shards, padded by XLA.
    log_probs = jax.nn.log_softmax(want[:3, :-1], axis=-1)
    want_ppl = np.exp(-np.take_along_axis(log_probs, np.asarray(tokens)[:3, 1:, None], axis=-1).mean())
    ppl = llama.perplexity(model, np.asarray(tokens[:3]).reshape(-1), window=16, batch=3, mesh="auto")
    np.testing.assert_allclose(ppl, want_ppl, rtol=1e-2)
