"""Tensor-parallel quantized linears (jax_w4a4.sharding) on 8 fake CPU devices."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jax_w4a4 import linear, quantize_linear
from jax_w4a4.formats import svdq_layout, w4a16_layout
from jax_w4a4.nn import QuantizedLinear
from jax_w4a4.reference import _lowrank
from jax_w4a4.sharding import ROW_PARALLEL_ALL_REDUCES, TensorParallelWeights, shard_model, shard_weights
from jax_w4a4.weights import SVDQuantWeights

N, K = 512, 1024
MODES = ("svdq-int4", "w4a8", "w4a16")
BF16_EPS = 2.0**-7  # one bf16 ulp is at most this, relative (8-bit significand)


@functools.cache
def _weights(mode: str, seed: int = 0):
    rng = np.random.default_rng(seed)
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
    """The K-slice [lo, hi) of the global weights as an unsharded layer without L_up and bias."""
    n, k = weights.out_features, weights.in_features
    if isinstance(weights, SVDQuantWeights):
        logical = svdq_layout.unprepack(weights.qweight, n, k)[:, lo // 2 : hi // 2]
        return dataclasses.replace(
            weights, qweight=svdq_layout.prepack(logical), wscales=weights.wscales[:, lo // 64 : hi // 64],
            smooth=weights.smooth[lo:hi], lora_down=weights.lora_down[lo:hi, :0], lora_up=weights.lora_up[:0],
            bias=None,
        )
    g = weights.group_size
    logical = w4a16_layout.unprepack(weights.qweight, n, k)[:, lo // 2 : hi // 2]
    return dataclasses.replace(
        weights, qweight=w4a16_layout.prepack(logical), scales=weights.scales[:, lo // g : hi // g],
        zeros=None if weights.zeros is None else weights.zeros[:, lo // g : hi // g], bias=None,
    )


def _row_expected(x, weights, shards):
    """Independent row-parallel math: per-slice unsharded layers, fp32 sum, L_up and bias once.

    Returns (expected output fp32, the magnitude that bounds rounding differences: Σ_s |partial_s|,
    plus 2 |LA|·|L_up| for svdq)."""
    step = weights.in_features // shards
    partials = [linear(x[..., s * step : (s + 1) * step], _slice_k(weights, s * step, (s + 1) * step))
                for s in range(shards)]
    partials = [p.astype(jnp.float32) for p in partials]
    acc, mass = sum(partials), sum(jnp.abs(p) for p in partials)
    if isinstance(weights, SVDQuantWeights):
        la = x.astype(jnp.float32) @ weights.lora_down.astype(jnp.float32)
        acc = acc + _lowrank(la, weights.lora_up, weights.dtype)
        # LA is rounded to bf16 after an fp32 sum whose order may flip that rounding: 1 ulp of LA.
        mass = mass + 2 * jnp.abs(la) @ jnp.abs(weights.lora_up.astype(jnp.float32))
    if weights.bias is not None:
        acc = acc + weights.bias.astype(jnp.float32)
    return acc.astype(weights.dtype).astype(jnp.float32), mass


def _weight_gathers(hlo: str, tp) -> list[str]:
    """all-gathers whose result has a weight array's global or local dims, or a packed-weight dtype."""
    dims = {",".join(map(str, a.shape)) for a in jax.tree.leaves(tp)}
    dims |= {",".join(map(str, s.data.shape)) for a in jax.tree.leaves(tp) for s in a.addressable_shards[:1]}
    lines = [line for line in hlo.splitlines() if "all-gather(" in line]
    return [line for line in lines if any(f"[{d}]" in line.split("all-gather(")[0] for d in dims)
            or "u8[" in line or "s32[" in line]


def _run(x, tp):
    compiled = jax.jit(linear).lower(x, tp).compile()
    return compiled(x, tp).astype(jnp.float32), compiled.as_text()


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)])
@pytest.mark.parametrize("style", ["column", "row"])
@pytest.mark.parametrize("mode", MODES)
def test_matches_unsharded(mode, style, mesh_shape, rng):
    mesh = _mesh(mesh_shape)
    weights = _weights(mode)
    tp = shard_weights(weights, mesh, style=style)
    batch = 4 if len(mesh_shape) == 2 else 5
    x = jnp.asarray(rng.standard_normal((batch, K)), jnp.bfloat16)
    if len(mesh_shape) == 2:
        x = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    y, hlo = _run(x, tp)
    want = linear(x, weights).astype(jnp.float32)
    assert "all-gather" not in hlo
    assert hlo.count("all-reduce(") == (ROW_PARALLEL_ALL_REDUCES if style == "row" else 0)
    if style == "column":  # each shard runs the unsharded layer on its columns
        assert y.sharding.spec[-1] == "tensor"
        np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
        return
    expected, partial_mass = _row_expected(x, weights, mesh.shape["tensor"])
    # Equal to the independent per-shard math up to fp32 summation order (one final rounding flip).
    np.testing.assert_array_less(np.abs(y - expected), BF16_EPS * (np.abs(expected) + partial_mass / 2**8) + 1e-6)
    # Versus the unsharded layer: each partial is rounded to bf16 once (half an ulp each) + output ulp.
    bound = BF16_EPS / 2 * partial_mass + BF16_EPS * np.abs(want)
    np.testing.assert_array_less(np.abs(y - want), bound + 1e-6)


@pytest.mark.parametrize("style", ["column", "row"])
def test_batch_not_dividing_data_axis(style, rng):
    mesh = _mesh((2, 4))
    weights = _weights("svdq-int4")
    tp = shard_weights(weights, mesh, style=style)
    x = jnp.asarray(rng.standard_normal((3, 2, K)), jnp.bfloat16)  # 3 tokens rows on a data axis of 2

    def f(x, tp):
        return linear(jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data", None, None))), tp)

    compiled = jax.jit(f).lower(x, tp).compile()
    y = compiled(x, tp).astype(jnp.float32)
    want = linear(x, weights).astype(jnp.float32)
    assert y.shape == (3, 2, N)
    assert _weight_gathers(compiled.as_text(), tp) == []  # x's uneven rows may be gathered; weights never
    if style == "column":
        np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
        return
    _, partial_mass = _row_expected(x, weights, mesh.shape["tensor"])
    np.testing.assert_array_less(np.abs(y - want), BF16_EPS / 2 * partial_mass + BF16_EPS * np.abs(want) + 1e-6)


def test_explicit_mesh_and_rank0(rng):
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    w = jnp.asarray(rng.standard_normal((N, K)), jnp.float32)
    weights = quantize_linear(w, None, mode="svdq-int4", rank=0)
    tp = shard_weights(weights, mesh, style="row")
    x = jax.device_put(jnp.asarray(rng.standard_normal((4, K)), jnp.bfloat16), NamedSharding(mesh, P("data", None)))
    y, hlo = _run(x, tp)
    assert "all-gather" not in hlo and hlo.count("all-reduce(") == ROW_PARALLEL_ALL_REDUCES
    expected, partial_mass = _row_expected(x, weights, 4)
    np.testing.assert_array_less(np.abs(y - expected), BF16_EPS * (np.abs(expected) + partial_mass / 2**8) + 1e-6)


def test_w4a16_act_order_column(rng):
    w = jnp.asarray(rng.standard_normal((N, K)), jnp.float32)
    g_idx = jnp.asarray(rng.permutation(np.arange(K) // 128), jnp.int32)
    weights = quantize_linear(w, None, mode="w4a16", group_size=128, g_idx=g_idx)
    tp = shard_weights(weights, _mesh((8,)), style="column")
    x = jnp.asarray(rng.standard_normal((3, K)), jnp.bfloat16)
    y, hlo = _run(x, tp)
    assert "all-gather" not in hlo
    np.testing.assert_array_equal(np.asarray(y), np.asarray(linear(x, weights).astype(jnp.float32)))
    with pytest.raises(ValueError, match="act-order"):
        shard_weights(weights, _mesh((8,)), style="row")


@pytest.mark.parametrize(
    "mode, n, k, style, match",
    [
        ("svdq-int4", 448, 512, "column", r"N \(out_features\) must be a multiple of 512"),
        ("w4a8", 512, 512, "row", r"K \(in_features\) must be a multiple of 1024"),
        ("svdq-int4", 512, 256, "row", r"K \(in_features\) must be a multiple of 512"),
        ("w4a16", 64, 512, "column", r"N \(out_features\) must be a multiple of 128"),
        ("w4a16", 512, 512, "row", r"K \(in_features\) must be a multiple of 1024"),
    ],
)
def test_misalignment_is_a_value_error(mode, n, k, style, match):
    weights = quantize_linear(jnp.ones((n, k)), mode=mode, rank=0, group_size=128)
    with pytest.raises(ValueError, match=match):
        shard_weights(weights, _mesh((8,)), style=style)


def test_bad_arguments():
    weights = _weights("w4a16")
    with pytest.raises(ValueError, match="style"):
        shard_weights(weights, _mesh((8,)), style="diagonal")
    with pytest.raises(ValueError, match="axis"):
        shard_weights(weights, _mesh((8,)), axis="model")


def test_two_layer_mlp_readme_example(rng):
    # The README "Sharded inference" example.
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    w_up = jnp.asarray(rng.standard_normal((1024, 512)), jnp.float32)
    w_down = jnp.asarray(rng.standard_normal((512, 1024)), jnp.float32) / 32
    up = shard_weights(quantize_linear(w_up, mode="svdq-int4"), mesh, style="column")
    down = shard_weights(quantize_linear(w_down, mode="svdq-int4"), mesh, style="row")
    mlp = jax.jit(lambda x, up, down: linear(jax.nn.gelu(linear(x, up)), down))
    x = jax.device_put(jnp.asarray(rng.standard_normal((8, 512)), jnp.bfloat16), NamedSharding(mesh, P("data")))
    y = mlp(x, up, down)  # (8, 512): one all-reduce, no weight all-gather
    hlo = mlp.lower(x, up, down).compile().as_text()
    assert "all-gather" not in hlo and hlo.count("all-reduce(") == 1
    hidden = jax.nn.gelu(linear(x, quantize_linear(w_up, mode="svdq-int4")))
    down_ref = quantize_linear(w_down, mode="svdq-int4")
    want = linear(hidden, down_ref).astype(jnp.float32)
    expected, partial_mass = _row_expected(hidden, down_ref, 4)
    y = y.astype(jnp.float32)
    np.testing.assert_array_less(np.abs(y - expected), BF16_EPS * (np.abs(expected) + partial_mass / 2**8) + 1e-6)
    np.testing.assert_array_less(np.abs(y - want), BF16_EPS / 2 * partial_mass + BF16_EPS * np.abs(want) + 1e-6)


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
    assert model.up.weights.weights.scales[...].sharding.spec == P("tensor", None)
    forward = nnx.jit(lambda m, x: m(x))
    y = np.asarray(forward(model, x).astype(jnp.float32))
    np.testing.assert_allclose(y, want, rtol=0, atol=2 * BF16_EPS * np.abs(want).max())
    assert not np.array_equal(y, np.zeros_like(y))
