"""Layers whose N or K are not multiples of the W4A4 kernel's 128 (SmolLM2: 576, 192): the weights are
stored zero-padded, ``linear`` pads x and cuts y, and the result is the logical layer's math."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jax_w4a4
from jax_w4a4 import nn as qnn
from jax_w4a4 import quantize as q
from jax_w4a4 import reference
from jax_w4a4.formats import svdq_layout
from tests import numpy_spec

SHAPES = [(576, 1536), (1536, 576)]  # (N, K): SmolLM2's down_proj and gate/up_proj
MODES = ["svdq-int4", "w4a8"]
RANK = 16


def _layer(rng, n, k):
    w = rng.standard_normal((n, k)) * 0.02 + (rng.standard_normal((n, 8)) @ rng.standard_normal((8, k))) * 0.02
    smooth = np.exp(rng.standard_normal(k) * 0.5)  # λ ≠ 1: the padded λ must not leak into the math
    return (jnp.asarray(w, jnp.float32), jnp.asarray(rng.standard_normal(n) * 0.1, jnp.float32),
            jnp.asarray(smooth, jnp.float32))


def _logical(weights):
    """The stored arrays cut to the logical (N, K), after asserting that the padding is zeros (λ = 1)."""
    n, k = weights.out_features, weights.in_features
    n_p, k_p = weights.padded_out_features, weights.padded_in_features
    qweight = np.asarray(svdq_layout.unprepack(weights.qweight, n_p, k_p))
    wscales = np.asarray(svdq_layout.unprepack_scales(weights.wscales), np.float32)
    for padded in (qweight[n:], qweight[:, k // 2 :], wscales[n:], wscales[:, k // 64 :],
                   np.asarray(weights.lora_down, np.float32)[k:], np.asarray(weights.lora_up, np.float32)[:, n:],
                   np.asarray(weights.bias, np.float32)[n:]):
        assert not padded.any()
    np.testing.assert_array_equal(np.asarray(weights.smooth)[k:], 1.0)
    return dict(
        qweight=qweight[:n, : k // 2], wscales=svdq_layout.unprepack_scales(weights.wscales)[:n, : k // 64],
        smooth=weights.smooth[:k],
        lora_down=weights.lora_down[:k], lora_up=weights.lora_up[:, :n], bias=weights.bias[:n],
    )


def _numpy_layer(x, logical, act_format):
    """Independent float64 math of the logical layer; a trailing fp8 group of 64 (K = 576) is a group
    of its own: scale = its absmax / 448. Returns Y (float64) and the slack for LA's rounding."""
    x32 = np.asarray(x, np.float32)
    x_hat = (x32 / np.asarray(logical["smooth"], np.float32)).astype(np.float32)
    k = x_hat.shape[-1]
    if act_format == "fp8":
        x_deq = np.empty(x_hat.shape, np.float64)
        for lo in range(0, k, 128):
            g = x_hat[..., lo : lo + 128]
            s = np.abs(g).max(-1, keepdims=True).astype(np.float32) / np.float32(448.0)
            v = np.where(s == 0, 0, g / np.where(s == 0, 1, s)).astype(np.float32)
            v = np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
            x_deq[..., lo : lo + 128] = v * s
        x_values, x_scales, x_group = x_deq, np.ones(x_hat.shape[:-1] + (1,)), k
    else:
        x_values, x_scales = numpy_spec.quantize_int4(x_hat, ml_dtypes.bfloat16, unsigned=False)
        x_group = 64
    q_w = numpy_spec.unpack_nibbles(logical["qweight"], signed=True)
    la = x32.astype(np.float64) @ np.asarray(logical["lora_down"], np.float64)
    y64 = numpy_spec.w4a4_gemm(
        x_values, x_scales, x_group, q_w, np.asarray(logical["wscales"], np.float32), la,
        np.asarray(logical["lora_up"], np.float32), ml_dtypes.bfloat16, bias=np.asarray(logical["bias"], np.float32),
    )
    return y64, numpy_spec.la_rounding_slack(x32, logical["lora_down"], logical["lora_up"], ml_dtypes.bfloat16)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_padded_layer_is_the_logical_layer(rng, n, k, mode):
    w, bias, smooth = _layer(rng, n, k)
    weights = jax_w4a4.quantize_linear(w, bias, mode=mode, rank=RANK, smooth=smooth)
    assert (weights.out_features, weights.in_features) == (n, k)
    assert (weights.padded_out_features, weights.padded_in_features) == (-(-n // 128) * 128, -(-k // 128) * 128)
    svdq_layout.check_shape(weights.padded_out_features, weights.padded_in_features)  # the GPU kernel's shapes
    x = jnp.asarray(rng.standard_normal((3, 5, k)) * np.exp(rng.standard_normal(k)) * 0.05, jnp.bfloat16)
    y = jax.jit(jax_w4a4.linear)(x, weights)
    assert y.shape == (3, 5, n) and y.dtype == jnp.bfloat16
    logical = _logical(weights)
    y64, la_slack = _numpy_layer(x, logical, weights.act_format)
    numpy_spec.assert_close_to_rounded(np.asarray(y, np.float32), y64, ml_dtypes.bfloat16, extra_slack=la_slack)
    if weights.act_format == "fp8" and k % 128:
        return  # no unpadded reference: the fp8 group of 128 does not divide K = 576
    # Where the unpadded layer exists, the padded one computes exactly its values.
    q_x, s_x, la = reference.act_quant(x, logical["smooth"], logical["lora_down"], act_format=weights.act_format)
    want = reference.w4a4_gemm(q_x, s_x, la, logical["qweight"], logical["wscales"], logical["lora_up"],
                               bias=logical["bias"], act_format=weights.act_format)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("mode", MODES)
def test_calibrated_padded_layer_save_load(rng, tmp_path, mode):
    n, k = SHAPES[1] if mode == "w4a8" else SHAPES[0]
    dense = nnx.Linear(k, n, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    x = jnp.asarray(rng.standard_normal((64, k)), jnp.float32)
    model = nnx.Sequential(dense)
    qnn.quantize_model(model, [x], default_mode=mode, default_options={"rank": RANK, "grid": [0.25, 0.75]},
                       progress=False)
    layer = model.layers[0]
    weights = layer.quantized_weights
    assert (layer.in_features, layer.out_features) == (k, n) and (weights.in_padding, weights.out_padding) != (0, 0)
    y = layer(x)
    assert y.shape == (64, n)
    y64, la_slack = _numpy_layer(x.astype(jnp.bfloat16), _logical(weights), weights.act_format)
    numpy_spec.assert_close_to_rounded(np.asarray(y, np.float32), y64, ml_dtypes.bfloat16, extra_slack=la_slack)
    qnn.save_quantized(model, tmp_path)
    fresh = nnx.Sequential(nnx.Linear(k, n, rngs=nnx.Rngs(0)))
    loaded = qnn.load_quantized(fresh, tmp_path).layers[0]
    assert (loaded.in_features, loaded.out_features) == (k, n)
    assert jax.tree.structure(loaded.quantized_weights) == jax.tree.structure(weights)  # paddings are static
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m(x))(loaded, x)), np.asarray(y))


def test_only_the_weight_group_constrains_k(rng):
    w = jnp.asarray(rng.standard_normal((192, 320)), jnp.float32)
    weights = jax_w4a4.quantize_linear(w, mode="w4a8", rank=0)
    assert (weights.padded_out_features, weights.padded_in_features) == (256, 384)
    assert (weights.out_padding, weights.in_padding) == (64, 64)
    with pytest.raises(ValueError, match=r"K \(w.shape\[1\]\) must be a multiple of 64"):
        q.svdquant(w[:, :96], None, jnp.ones((8, 96)), rank=0)
    aligned = jax_w4a4.quantize_linear(w[:128, :256], mode="svdq-int4", rank=0)
    assert (aligned.in_padding, aligned.out_padding) == (0, 0)
