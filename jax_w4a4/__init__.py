"""jax_w4a4: fused 4-bit quantized linear layers for JAX on NVIDIA Hopper.

    w = jax_w4a4.quantize_linear(W, bias, mode="svdq-int4", rank=32)   # W: (out, in)
    y = jax.jit(jax_w4a4.linear)(x, w)                                  # x: (..., in)
"""

from jax_w4a4.export import export_safety_checks
from jax_w4a4.linear import linear
from jax_w4a4.sharding import shard_model, shard_weights
from jax_w4a4.weights import (
    MODES,
    FakeQuantFP4Weights,
    QuantizedWeights,
    SVDQuantWeights,
    W4A16Weights,
    quantize_fp4,
    quantize_linear,
)

__version__ = "0.1.0"

__all__ = [
    "MODES",
    "FakeQuantFP4Weights",
    "QuantizedWeights",
    "SVDQuantWeights",
    "W4A16Weights",
    "export_safety_checks",
    "linear",
    "quantize_fp4",
    "quantize_linear",
    "shard_model",
    "shard_weights",
]
