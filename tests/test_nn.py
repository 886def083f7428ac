"""Flax NNX: QuantizedLinear, quantize_model with path rules, save / load, nnx.jit."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import jax_w4a4
from jax_w4a4 import nn as qnn
from jax_w4a4 import quantize as q
from jax_w4a4.formats import svdq_layout, w4a16_layout

D_IN, D_HIDDEN, D_OUT = 128, 128, 64
FAST_SVDQ = {"grid": [0.25, 0.5, 0.75], "rank": 16}  # a short grid keeps the tests quick


class MLP(nnx.Module):
    """Linear blocks ``widths[i] -> widths[i+1]`` with ReLU, then a head to D_OUT (no bias)."""

    def __init__(self, rngs: nnx.Rngs, dtype=None, widths=(D_IN, D_HIDDEN, D_IN)):
        self.blocks = nnx.List([
            nnx.Linear(a, b, dtype=dtype, rngs=rngs) for a, b in zip(widths[:-1], widths[1:])
        ])
        self.head = nnx.Linear(widths[-1], D_OUT, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = jax.nn.relu(block(x))
        return self.head(x)


def _inputs(rng, lead=(4, 16)):
    x = rng.standard_normal((*lead, D_IN))
    x[..., [3, 50]] *= 10  # outlier channels
    return jnp.asarray(x, jnp.float32)


def _assert_bf16_close(a, b):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("mode", ["svdq-int4", "w4a16", "nvfp4"])
def test_quantized_linear_is_linear_of_its_weights(rng, mode):
    dense = nnx.Linear(D_IN, D_HIDDEN, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    x = _inputs(rng)
    options = {"svdq-int4": FAST_SVDQ, "w4a16": {"group_size": 64}, "nvfp4": {}}[mode]
    layer = qnn.QuantizedLinear.from_linear(dense, x, mode, **options)
    assert (layer.in_features, layer.out_features, layer.use_bias) == (D_IN, D_HIDDEN, True)
    y = layer(x)
    # Same computation as jax_w4a4.linear on the weights (the nnx.Linear kernel transposed to W (out, in)).
    want = jax_w4a4.linear(x.astype(jnp.bfloat16), layer.quantized_weights)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want, np.float32))
    assert y.dtype == jnp.float32  # dtype=None, float32 params and inputs: as nnx.Linear
    assert _rel(y, dense(x)) < 0.12
    assert isinstance(nnx.state(layer, qnn.QuantizedArray), nnx.State) and not nnx.state(layer, nnx.Param)


def test_quantized_linear_dtype_and_out_sharding(rng):
    dense = nnx.Linear(D_IN, D_HIDDEN, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    layer = qnn.QuantizedLinear.from_linear(dense, None, "w4a16", method="rtn")
    x = _inputs(rng, lead=(8, 4))
    assert layer(x).dtype == jnp.bfloat16 == dense(x).dtype
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    spec = NamedSharding(mesh, PartitionSpec("data", None, "model"))
    y = jax.jit(lambda m, x: m(x, out_sharding=spec))(layer, x)
    assert y.sharding.is_equivalent_to(spec, y.ndim)
    _assert_bf16_close(y, layer(x))  # partitioned sums may round differently
    explicit = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(explicit):
        xs = jax.device_put(x, NamedSharding(explicit, PartitionSpec("data")))
        y = jax.jit(lambda m, x: m(x, out_sharding=PartitionSpec("data", None, "model")))(layer, xs)
    assert y.sharding.spec == PartitionSpec("data", None, "model")
    _assert_bf16_close(y, layer(x))  # partitioned sums may round differently


def test_plan_rules_first_match_globs_and_regexes():
    model = MLP(nnx.Rngs(0))
    rules = {
        "head": None,
        "re:^blocks/[1-9]$": {"mode": "w4a16", "group_size": 64},
        "blocks/*": "w4a8",
    }
    plans = {p.name: p.config for p in qnn.plan_quantization(model, rules, default_mode="svdq-int4")}
    assert plans["head"] is None
    assert plans["blocks/1"].mode == "w4a16" and plans["blocks/1"].options["group_size"] == 64
    assert plans["blocks/0"].mode == "w4a8" and plans["blocks/0"].options["dtype"] == "bfloat16"
    assert qnn.rule_matches("head", "decoder/head") and not qnn.rule_matches("head", "decoder/head2")
    plans = {p.name: p.config for p in qnn.plan_quantization(
        model, {"blocks/0": {"rank": 48}}, default_mode="w4a8", default_options={"rank": 64, "group_size": 32}
    )}
    assert plans["blocks/0"].options["rank"] == 48 and plans["blocks/1"].options["rank"] == 64
    with pytest.warns(UserWarning, match="lm_head"):
        qnn.plan_quantization(model, {"lm_head": None})
    with pytest.raises(ValueError, match="unknown option"):
        qnn.plan_quantization(model, {"head": {"mode": "nvfp4", "rank": 16}})
    with pytest.raises(ValueError, match="regex"):
        qnn.plan_quantization(model, {"re:(": None})


def test_quantize_model_with_rules(rng):
    model = MLP(nnx.Rngs(int(rng.integers(1 << 30))))
    batches = [_inputs(rng) for _ in range(3)]
    x = _inputs(rng)
    y_fp = model(x)
    head = model.head
    report = []
    out = qnn.quantize_model(
        model, batches,
        {"head": None, "blocks/1": {"mode": "w4a16", "group_size": 64, "act_order": True}},
        default_mode="svdq-int4", default_options=FAST_SVDQ,
        compare={"rtn": {"mode": "svdq-int4", "grid": None, "residual": "rtn"}}, report=report, progress=False,
    )
    assert out is model and model.head is head  # in place; the kept layer is untouched
    assert isinstance(model.blocks[0], qnn.QuantizedLinear) and isinstance(model.blocks[1], qnn.QuantizedLinear)
    assert isinstance(model.blocks[0].quantized_weights, jax_w4a4.SVDQuantWeights)
    w16 = model.blocks[1].quantized_weights
    assert isinstance(w16, jax_w4a4.W4A16Weights) and w16.g_idx is not None
    # blocks/1 sees ReLU outputs: non-negative, but "int4" is the default; blocks/0 compares with RTN.
    assert [(r.path, r.label, r.chosen) for r in report] == [
        ("blocks/0", "svdq-int4", True), ("blocks/0", "rtn", False),
        ("blocks/1", "w4a16", True), ("blocks/1", "rtn", False),
    ]
    assert report[0].rel_error < report[1].rel_error and report[0].tokens == 3 * 64
    assert _rel(model(x), y_fp) < 0.15
    assert "blocks/0" in q.format_report(report)


def test_quantize_model_sequential_passes_see_quantized_inputs(rng):
    model = MLP(nnx.Rngs(1))
    batches = [_inputs(rng, lead=(32,)) for _ in range(2)]
    one_pass = nnx.clone(model)
    reference = nnx.clone(model)
    config = {"grid": [0.3, 0.6], "rank": 16, "residual": "rtn"}  # data-dependent, order-independent
    kwargs = dict(default_mode="svdq-int4", default_options=config, progress=False)
    qnn.quantize_model(model, batches, {"head": None}, layers_per_pass=1, **kwargs)
    qnn.quantize_model(one_pass, batches, {"head": None}, **kwargs)
    # By hand: layer 0 from the model inputs, layer 1 from the *quantized* layer 0's outputs.
    first = qnn.QuantizedLinear.from_linear(reference.blocks[0], jnp.concatenate(batches), "svdq-int4", **config)
    hidden = jnp.concatenate([jax.nn.relu(first(b)) for b in batches])
    second = qnn.QuantizedLinear.from_linear(reference.blocks[1], hidden, "svdq-int4", **config)
    for got, want in ((model.blocks[0], first), (model.blocks[1], second)):
        for a, b in zip(jax.tree.leaves(got.quantized_weights), jax.tree.leaves(want.quantized_weights)):
            np.testing.assert_array_equal(a, b)
    # In one pass, layer 1 calibrates on full-precision inputs: other smoothing factors.
    assert not np.array_equal(one_pass.blocks[1].quantized_weights.smooth, second.quantized_weights.smooth)
    np.testing.assert_array_equal(one_pass.blocks[0].quantized_weights.smooth, first.quantized_weights.smooth)


def test_quantize_model_errors(rng):
    batches = [_inputs(rng)]
    with pytest.raises(ValueError, match="traced input"):
        qnn.quantize_model(MLP(nnx.Rngs(0)), batches, forward=nnx.jit(lambda m, b: m(b)), progress=False)

    class Unused(nnx.Module):
        def __init__(self):
            self.used = nnx.Linear(D_IN, D_IN, rngs=nnx.Rngs(0))
            self.unused = nnx.Linear(D_IN, D_IN, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.used(x)

    with pytest.raises(ValueError, match="'unused' was not called"):
        qnn.quantize_model(Unused(), batches, default_mode="nvfp4", progress=False)
    model = Unused()
    qnn.quantize_model(model, batches, {"unused": None}, default_mode="nvfp4", progress=False)
    assert isinstance(model.used, qnn.QuantizedLinear) and isinstance(model.unused, nnx.Linear)


def test_save_load_round_trip_and_jit(rng, tmp_path):
    widths = (D_IN, D_HIDDEN, D_IN, D_IN)

    def build(seed, widths=widths):
        return MLP(nnx.Rngs(seed), dtype=jnp.bfloat16, widths=widths)

    model = build(3)
    qnn.quantize_model(
        model, [_inputs(rng)],
        {
            "head": None,
            "blocks/1": {"mode": "w4a16", "zero_point": True, "group_size": 64, "act_order": True},
            "blocks/2": {"mode": "nvfp4", "dtype": "bfloat16"},  # bf16 tensors in the file too
        },
        default_mode="w4a8", default_options={**FAST_SVDQ, "dtype": "float16"}, progress=False,
    )
    x = _inputs(rng)
    y = model(x)
    assert y.dtype == jnp.bfloat16 and model.blocks[0].quantized_weights.dtype == jnp.float16
    assert isinstance(model.head, nnx.Linear)
    qnn.save_quantized(model, tmp_path / "ckpt")
    saved_state = nnx.to_flat_state(nnx.state(model))
    for fresh in (build(9), nnx.eval_shape(lambda: build(9))):
        loaded = qnn.load_quantized(fresh, tmp_path / "ckpt")
        loaded_state = nnx.to_flat_state(nnx.state(loaded))
        assert [p for p, _ in saved_state] == [p for p, _ in loaded_state]
        for (path, a), (_, b) in zip(saved_state, loaded_state):
            a, b = np.asarray(a.get_value()), np.asarray(b.get_value())
            assert a.dtype == b.dtype and a.shape == b.shape, path
            assert a.tobytes() == b.tobytes(), path  # bit-exact
        assert loaded.blocks[1].config == model.blocks[1].config
        np.testing.assert_array_equal(loaded(x), y)
    # nnx.jit of the quantized model; split / merge keep it whole.
    np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x))(loaded, x), y)
    graphdef, state = nnx.split(loaded)
    np.testing.assert_array_equal(nnx.merge(graphdef, state)(x), y)
    with pytest.raises(ValueError, match="checkpoint"):  # a model of another width
        qnn.load_quantized(build(0, widths=(D_IN, 192, D_IN, D_IN)), tmp_path / "ckpt")

    # Files of earlier versions load into the same model: version 2 stored the w4a16 scales and zero
    # points in their logical (N, K/G) layout, version 1 also the svdq weight scales (N, K/64).
    config = json.loads((tmp_path / "ckpt" / qnn.io.CONFIG_FILE).read_text())
    current = safetensors.numpy.load_file(tmp_path / "ckpt" / qnn.io.TENSORS_FILE)
    w4a16_keys = ["blocks/1/weights/scales", "blocks/1/weights/zeros"]
    svdq_scales = [key for key in current if key.endswith("/weights/wscales")]
    assert svdq_scales and all(key in current for key in w4a16_keys)  # the w4a8 blocks, the w4a16 block
    for version in (2, 1):
        old = tmp_path / f"ckpt_v{version}"
        old.mkdir()
        tensors = dict(current)
        for key in w4a16_keys:
            tensors[key] = np.asarray(w4a16_layout.unprepack_scales(tensors[key]))
        for key in svdq_scales if version == 1 else ():
            tensors[key] = np.asarray(svdq_layout.unprepack_scales(tensors[key]))
        safetensors.numpy.save_file(tensors, old / qnn.io.TENSORS_FILE)
        (old / qnn.io.CONFIG_FILE).write_text(json.dumps({**config, "version": version}))
        np.testing.assert_array_equal(qnn.load_quantized(build(9), old)(x), y)
    (old / qnn.io.CONFIG_FILE).write_text(json.dumps({**config, "version": 0}))
    with pytest.raises(ValueError, match=r"config of version 1 or 2 or 3 \(format='jax_w4a4.nn', version=0\)"):
        qnn.load_quantized(build(9), old)
