"""Flax NNX layers for quantized models: ``QuantizedLinear``, ``quantize_model``, save / load.

API (``jax_w4a4/nn/{linear,model,io}.py``)::

    from jax_w4a4 import nn as qnn

    model = qnn.quantize_model(
        model,                       # any nnx.Module tree; its nnx.Linear layers are quantized in place
        calibration_batches,         # iterable of batches; each is fed as forward(model, batch)
        rules={                      # first matching pattern wins (dict order)
            "lm_head": None,                                   # keep in full precision
            "*/mlp/down_proj": {"mode": "w4a16", "group_size": 128},
            "re:.*attn/(q|k|v)_proj$": {"mode": "svdq-int4", "rank": 32},
        },
        default_mode="svdq-int4",    # for layers no rule matches; None keeps them in full precision
        default_options=None,        # options applied to every quantized layer (a rule's override them)
        forward=None,                # default: model(batch) / model(*batch) for tuples / model(**batch) for dicts
        report=None,                 # a list: per-layer relative output errors (LayerError) are appended
        compare=None,                # {label: spec}: further configurations measured for the report
        layers_per_pass=None,        # k: calibrate/quantize k layers per pass, later ones see them quantized
    )
    jax_w4a4.quantize.print_report(report)        # one row per layer, one column per configuration
    y = model(x)                                   # eager, or under nnx.jit
    qnn.save_quantized(model, "ckpt_dir")          # ckpt_dir/model.safetensors + quantization.json
    model2 = qnn.load_quantized(fresh_model, "ckpt_dir")   # fresh_model: same architecture, unquantized
                                                           # (may be abstract: nnx.eval_shape(...))

Rules: keys are layer paths patterns, matched against the layer's path in the module tree joined
with "/" (e.g. ``"layers/3/mlp/down_proj"``). A plain key is a glob (``fnmatch``: ``*``, ``?``,
``[...]``) matched against the whole path or any trailing part of it that starts at a "/" (so
``"lm_head"`` matches ``"lm_head"`` and ``"decoder/lm_head"``); a key starting with ``"re:"`` is a
regular expression searched in the path (``re.search``). Values:

* ``None``: keep the layer as the original ``nnx.Linear``;
* a mode string: ``"svdq-int4"``, ``"w4a8"``, ``"w4a16"``, ``"nvfp4"``, ``"mxfp4"`` with default options;
* a dict ``{"mode": ..., **options}`` (``mode`` may be left out: then ``default_mode``); the options
  per mode are those of :func:`jax_w4a4.quantize.quantize_layer` (e.g. ``rank``, ``grid``,
  ``residual``, ``act_format`` for svdq-int4 / w4a8; ``method``, ``group_size``, ``zero_point``,
  ``act_order`` for w4a16; ``dtype`` for all).
"""

from jax_w4a4.nn.io import load_quantized, save_quantized
from jax_w4a4.nn.linear import QuantizedArray, QuantizedLinear, apply_out_sharding
from jax_w4a4.nn.model import (
    KEEP,
    LayerPlan,
    Rules,
    default_forward,
    plan_quantization,
    quantize_model,
    rule_matches,
)

__all__ = [
    "KEEP",
    "LayerPlan",
    "QuantizedArray",
    "QuantizedLinear",
    "Rules",
    "apply_out_sharding",
    "default_forward",
    "load_quantized",
    "plan_quantization",
    "quantize_model",
    "rule_matches",
    "save_quantized",
]
