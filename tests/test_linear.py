"""Public API: quantize_linear + linear for every mode, pytrees, jit / vmap / export, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_w4a4
from jax_w4a4 import SVDQuantWeights, W4A16Weights

N, K = 256, 512


def _layer(rng):
    """A weight with a strong low-rank part and two outlier input channels, like real layers."""
    w = rng.standard_normal((N, K)) * 0.02 + (rng.standard_normal((N, 8)) @ rng.standard_normal((8, K))) * 0.05
    w[:, [7, 100]] *= 8
    bias = rng.standard_normal(N) * 0.1
    return jnp.asarray(w, jnp.float32), jnp.asarray(bias, jnp.float32)


def _inputs(rng, lead=(3, 7), dtype=jnp.bfloat16):
    x = rng.standard_normal((*lead, K))
    x[..., 5] *= 20
    return jnp.asarray(x, dtype)


def _rel_err(y, x, w, bias):
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T + np.asarray(bias, np.float64)
    return np.linalg.norm(np.asarray(y, np.float64) - exact) / np.linalg.norm(exact)


# Relative output error of RTN on a Gaussian layer with Gaussian inputs. 4-bit RTN with absmax scales
# gives about 0.1 per quantized operand (step ≈ 0.36σ ⇒ error ≈ 0.1σ); measured 0.153 / 0.13 / 0.093 /
# 0.111 / 0.081 / 0.128 over seeds and dtypes. The bounds leave ~25% margin: a wrong scale, nibble or
# group mapping lands far above them.
MODES = [
    (dict(mode="svdq-int4", rank=0), 0.19),
    (dict(mode="svdq-int4", rank=32), 0.165),
    (dict(mode="w4a8", rank=32), 0.12),
    (dict(mode="w4a16", group_size=128), 0.14),
    (dict(mode="w4a16", group_size=32, zero_point=True), 0.10),
    (dict(mode="w4a16", group_size=-1), 0.16),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("kwargs,bound", MODES)
def test_linear_close_to_full_precision(rng, kwargs, bound, dtype):
    w = jnp.asarray(rng.standard_normal((N, K)) * 0.05, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(N) * 0.1, jnp.float32)
    weights = jax_w4a4.quantize_linear(w, bias, dtype=dtype, **kwargs)
    x = jnp.asarray(rng.standard_normal((3, 7, K)), dtype)
    y = jax.jit(jax_w4a4.linear)(x, weights)
    assert y.shape == (3, 7, N) and y.dtype == dtype
    err = _rel_err(y, x, w, bias)
    assert err < bound, f"{kwargs}: relative error {err:.4f} >= {bound}"


def test_low_rank_branch_reduces_error(rng):
    w, bias = _layer(rng)
    x = _inputs(rng)
    errs = {r: _rel_err(jax_w4a4.linear(x, jax_w4a4.quantize_linear(w, bias, rank=r)), x, w, bias) for r in (0, 32)}
    assert errs[32] < 0.7 * errs[0], errs


def test_unsigned_activations(rng):
    w, bias = _layer(rng)
    x = jnp.abs(_inputs(rng))
    weights = jax_w4a4.quantize_linear(w, bias, rank=16, unsigned_activations=True)
    assert weights.act_format == "uint4"
    signed = jax_w4a4.quantize_linear(w, bias, rank=16)
    assert _rel_err(jax_w4a4.linear(x, weights), x, w, bias) < _rel_err(jax_w4a4.linear(x, signed), x, w, bias)


def test_weights_are_pytrees(rng):
    w, bias = _layer(rng)
    for weights in (jax_w4a4.quantize_linear(w, bias), jax_w4a4.quantize_linear(w, mode="w4a16", zero_point=True)):
        leaves, treedef = jax.tree_util.tree_flatten(weights)
        assert all(isinstance(leaf, jax.Array) for leaf in leaves)
        rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
        assert type(rebuilt) is type(weights) and rebuilt.in_features == K and rebuilt.out_features == N
    assert jax_w4a4.quantize_linear(w, mode="w4a8").act_format == "fp8"
    assert isinstance(jax_w4a4.quantize_linear(w, mode="w4a16"), W4A16Weights)
    assert isinstance(jax_w4a4.quantize_linear(w), SVDQuantWeights)


def test_weights_pass_through_jit_as_arguments(rng):
    w, bias = _layer(rng)
    weights = jax_w4a4.quantize_linear(w, bias, mode="w4a16")
    x = _inputs(rng)
    calls = []

    @jax.jit
    def f(x, weights):
        calls.append(1)
        return jax_w4a4.linear(x, weights)

    f(x, weights)
    f(x, jax_w4a4.quantize_linear(w * 2, bias, mode="w4a16"))
    assert len(calls) == 1  # same structure and shapes: no retrace


@pytest.mark.parametrize("mode", ["svdq-int4", "w4a16"])
def test_vmap_over_batch_and_over_stacked_layers(rng, mode):
    w, bias = _layer(rng)
    x = _inputs(rng, lead=(4, 2))
    weights = jax_w4a4.quantize_linear(w, bias, mode=mode)
    direct = jax_w4a4.linear(x, weights)
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(jax_w4a4.linear, in_axes=(0, None))(x, weights), np.float32), np.asarray(direct, np.float32)
    )
    stack = [jax_w4a4.quantize_linear(w * s, bias, mode=mode) for s in (1.0, 0.5)]
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *stack)
    per_layer = jax.vmap(jax_w4a4.linear, in_axes=(None, 0))(x, stacked)
    for i, layer in enumerate(stack):
        np.testing.assert_array_equal(np.asarray(per_layer[i], np.float32), np.asarray(jax_w4a4.linear(x, layer), np.float32))


@pytest.mark.parametrize("mode", ["svdq-int4", "w4a8", "w4a16"])
def test_export_serialize_deserialize_call(rng, mode):
    w, bias = _layer(rng)
    weights = jax_w4a4.quantize_linear(w, bias, mode=mode)
    x = _inputs(rng)
    exported = jax.export.export(jax.jit(jax_w4a4.linear), disabled_checks=jax_w4a4.export_safety_checks())(x, weights)
    restored = jax.export.deserialize(exported.serialize())
    np.testing.assert_array_equal(
        np.asarray(restored.call(x, weights), np.float32), np.asarray(jax_w4a4.linear(x, weights), np.float32)
    )


def test_errors_name_the_argument(rng):
    w, bias = _layer(rng)
    weights = jax_w4a4.quantize_linear(w, bias)
    with pytest.raises(ValueError, match=r"x.shape\[-1\] must be in_features=512, got 256"):
        jax_w4a4.linear(_inputs(rng)[..., :256], weights)
    with pytest.raises(ValueError, match=r"x must have the layer's dtype bfloat16.*got float16"):
        jax_w4a4.linear(_inputs(rng, dtype=jnp.float16), weights)
    with pytest.raises(ValueError, match=r"mode must be one of"):
        jax_w4a4.quantize_linear(w, mode="int3")
    with pytest.raises(ValueError, match=r"rank r\) must be a multiple of 16"):
        jax_w4a4.quantize_linear(w, rank=20)
    with pytest.raises(ValueError, match=r"bias must have shape \(256,\)"):
        jax_w4a4.quantize_linear(w, bias[:10])
    with pytest.raises(ValueError, match=r"w must be 2-D"):
        jax_w4a4.quantize_linear(w[0])
    with pytest.raises(ValueError, match=r"K \(w.shape\[1\]\) must be a multiple of 64 \(the svdq weight group"):
        jax_w4a4.quantize_linear(w[:, :96], mode="w4a8")
    with pytest.raises(ValueError, match=r"dtype must be one of"):
        jax_w4a4.quantize_linear(w, dtype=jnp.float32)
    with pytest.raises(TypeError, match=r"weights must be SVDQuantWeights, W4A16Weights"):
        jax_w4a4.linear(_inputs(rng), w)
