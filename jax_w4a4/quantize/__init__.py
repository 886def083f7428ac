"""Offline quantization: SVDQuant (smoothing search + low-rank + RTN/GPTQ residual), GPTQ, RTN, FP4.

    from jax_w4a4 import quantize as q
    calib = q.Calibration.from_activations(x)                  # x: (tokens, K) inputs of the layer
    w4a4 = q.svdquant(w, bias, calib, rank=32)                  # SVDQuantWeights, a searched per layer
    w4a16 = q.gptq(w, calib, bias=bias, group_size=128, act_order=True)    # W4A16Weights
    any_mode = q.quantize_layer(w, bias, calib, "w4a8", rank=32)          # one entry point
    q.print_report(q.compare_layer(w, bias, calib, {"svdq": "svdq-int4", "w4a16": "w4a16"}))

``w`` is ``(N, K)`` (out_features, in_features). Everything heavy is jit-compiled; on a GPU the
output-error objective runs the CUDA kernels through :func:`jax_w4a4.linear`.
"""

from jax_w4a4.quantize._gptq import GPTQResult, GroupGrid, gptq, gptq_quantize, gptq_svdq_residual
from jax_w4a4.quantize._svdquant import (
    DEFAULT_GRID,
    SmoothingSearch,
    search_smoothing,
    smoothing_factors,
    svdquant,
)
from jax_w4a4.quantize.calibration import Calibration
from jax_w4a4.quantize.checkpoints import from_awq, from_gptq
from jax_w4a4.quantize.layer import (
    DEFAULT_OPTIONS,
    QUANT_MODES,
    QuantConfig,
    as_config,
    compare_layer,
    layer_error,
    quantize_layer,
)
from jax_w4a4.quantize.progress import progress
from jax_w4a4.quantize.report import LayerError, format_report, print_report, relative_output_error

__all__ = [
    "DEFAULT_GRID",
    "DEFAULT_OPTIONS",
    "QUANT_MODES",
    "Calibration",
    "GPTQResult",
    "GroupGrid",
    "LayerError",
    "QuantConfig",
    "SmoothingSearch",
    "as_config",
    "compare_layer",
    "format_report",
    "from_awq",
    "from_gptq",
    "gptq",
    "gptq_quantize",
    "gptq_svdq_residual",
    "layer_error",
    "print_report",
    "progress",
    "quantize_layer",
    "relative_output_error",
    "search_smoothing",
    "smoothing_factors",
    "svdquant",
]
