"""``QuantizedLinear``: a drop-in for ``nnx.Linear`` whose weights are a quantized pytree."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jax_w4a4.linear import linear
from jax_w4a4.quantize.layer import QuantConfig, as_config, quantize_layer
from jax_w4a4.weights import QuantizedWeights

Sharding = NamedSharding | PartitionSpec


class QuantizedArray(nnx.Variable):
    """A tensor of a quantized layer (packed values, scales, low-rank factors, bias): model state that
    checkpoints and ``nnx.split`` carry, but not an ``nnx.Param`` (optimizers must not train it)."""


def _is_variable(node: Any) -> bool:
    return isinstance(node, nnx.Variable)


def apply_out_sharding(y: jax.Array, out_sharding: Sharding | None) -> jax.Array:
    """Places ``y`` like ``nnx.Linear(..., out_sharding=...)`` would: ``jax.sharding.reshard`` when the
    mesh has explicit axes (sharding in types), else ``jax.lax.with_sharding_constraint``."""
    if out_sharding is None:
        return y
    mesh = out_sharding.mesh if isinstance(out_sharding, NamedSharding) else jax.sharding.get_abstract_mesh()
    if mesh.explicit_axes:
        return jax.sharding.reshard(y, out_sharding)
    return jax.lax.with_sharding_constraint(y, out_sharding)


class QuantizedLinear(nnx.Module):
    """A quantized ``nnx.Linear``: ``y = linear(x, weights)`` (:func:`jax_w4a4.linear`).

    The weights pytree (``SVDQuantWeights``, ``W4A16Weights`` or ``FakeQuantFP4Weights``) is held as
    nnx state (every array a :class:`QuantizedArray` under ``weights/<field>``), so ``nnx.split``,
    ``nnx.merge``, ``nnx.jit`` and ``nnx.state`` see it. ``weights`` use the torch orientation
    ``W (out, in)``; :meth:`from_linear` transposes an ``nnx.Linear`` kernel ``(in, out)``.

    Call convention and dtypes follow ``nnx.Linear``: inputs ``(..., in_features)`` of any float
    dtype are cast to the quantized layer's dtype (bf16 / fp16, what the kernels take); the output has
    ``dtype`` when given, else the promotion of the input dtype and ``param_dtype`` (as nnx.Linear
    with ``dtype=None``).

    Any ``in_features`` that is a multiple of 64 and any ``out_features`` work in the W4A4 / W4A8
    modes: ``SVDQuantWeights`` hold the weight zero-padded to the CUDA kernel's multiples of 128, and
    :func:`jax_w4a4.linear` pads the inputs and cuts the outputs (exact; see SVDQuantWeights), so the
    layer keeps the logical sizes, on every platform and through save / load.

    Attributes:
      weights: the quantized weights (a pytree of QuantizedArray).
      in_features, out_features, use_bias: as nnx.Linear (the logical sizes).
      dtype: the output dtype (None: promote inputs with ``param_dtype``). param_dtype: as nnx.Linear.
      config: the :class:`jax_w4a4.quantize.QuantConfig` that produced the weights (for reports and
        checkpoints), or None.
    """

    def __init__(
        self,
        weights: QuantizedWeights,
        *,
        dtype: jnp.dtype | None = None,
        param_dtype: jnp.dtype = jnp.float32,
        config: QuantConfig | None = None,
    ):
        self.weights = nnx.data(jax.tree.map(QuantizedArray, weights))
        self.in_features = weights.in_features
        self.out_features = weights.out_features
        self.use_bias = weights.bias is not None
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.config = config

    @classmethod
    def from_linear(
        cls,
        module: nnx.Linear,
        calib: Any = None,
        config: QuantConfig | str = "svdq-int4",
        **options: Any,
    ) -> QuantizedLinear:
        """Quantizes an ``nnx.Linear`` (kernel ``(in, out)`` → ``W (out, in)``) with
        :func:`jax_w4a4.quantize.quantize_layer` (``calib``: its inputs or a Calibration)."""
        config = as_config(config if isinstance(config, QuantConfig) else {"mode": config, **options})
        w, bias = linear_weights(module)
        weights = quantize_layer(w, bias, calib, config)
        return cls(weights, dtype=module.dtype, param_dtype=module.param_dtype, config=config)

    @property
    def quantized_weights(self) -> QuantizedWeights:
        """The weights pytree with plain arrays (what :func:`jax_w4a4.linear` takes)."""
        return jax.tree.map(lambda v: v[...], self.weights, is_leaf=_is_variable)

    def __call__(self, inputs: jax.Array, out_sharding: Sharding | None = None) -> jax.Array:
        weights = self.quantized_weights
        out_dtype = self.dtype if self.dtype is not None else jnp.result_type(inputs.dtype, self.param_dtype)
        y = linear(inputs.astype(weights.dtype), weights).astype(out_dtype)
        return apply_out_sharding(y, out_sharding)


def linear_weights(module: nnx.Linear) -> tuple[jax.Array, jax.Array | None]:
    """``(W (out, in) fp32, bias fp32 or None)`` of an ``nnx.Linear``."""
    w = jnp.asarray(module.kernel[...], jnp.float32).T
    bias = None if module.bias is None else jnp.asarray(module.bias[...], jnp.float32)
    return w, bias
