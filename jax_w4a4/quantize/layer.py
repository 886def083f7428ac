"""One entry point for every mode and method: ``quantize_layer(w, bias, calib, mode, **options)``.

* ``"svdq-int4"``: W4A4 + low rank (:func:`svdquant`); ``rank=32, grid=DEFAULT_GRID, residual="gptq",
  act_format="int4"`` (``"uint4"`` for inputs ≥ 0; ``"auto"``: uint4 when every calibration input is ≥ 0).
* ``"w4a8"``: the same weights with fp8 activations; ``rank=32, grid=DEFAULT_GRID, residual="gptq"``.
* ``"w4a16"``: weight-only int4 (:func:`gptq` or RTN); ``method="gptq", group_size=128,
  zero_point=False, act_order=False``.
* ``"nvfp4"``, ``"mxfp4"``: fake-quantized FP4 weights, RTN (XLA ops, no Hopper kernel yet).

Every mode also takes ``dtype`` (the layer's dtype, ``"bfloat16"`` or ``"float16"``); the GPTQ methods
take ``block_size=128`` and ``damp=0.01``. Plain round-to-nearest is ``grid=None, residual="rtn"``
(svdq-int4 / w4a8, identical to :func:`jax_w4a4.quantize_linear`) or ``method="rtn"`` (w4a16).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jax_w4a4.ops import checks
from jax_w4a4.quantize._gptq import DEFAULT_BLOCK_SIZE, DEFAULT_DAMP, gptq
from jax_w4a4.quantize._svdquant import DEFAULT_GRID, svdquant
from jax_w4a4.quantize.calibration import Calibration, as_calibration
from jax_w4a4.quantize.report import LayerError, relative_output_error
from jax_w4a4.weights import QuantizedWeights, quantize_fp4, quantize_linear

QUANT_MODES: tuple[str, ...] = ("svdq-int4", "w4a8", "w4a16", "nvfp4", "mxfp4")
W4A16_METHODS = ("gptq", "rtn")

_COMMON = {"dtype": "bfloat16"}
_GPTQ = {"block_size": DEFAULT_BLOCK_SIZE, "damp": DEFAULT_DAMP}
_SVDQ = {"rank": 32, "grid": list(DEFAULT_GRID), "residual": "gptq", **_GPTQ, **_COMMON}
DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "svdq-int4": {**_SVDQ, "act_format": "int4"},
    "w4a8": dict(_SVDQ),
    "w4a16": {"method": "gptq", "group_size": 128, "zero_point": False, "act_order": False, **_GPTQ, **_COMMON},
    "nvfp4": dict(_COMMON),
    "mxfp4": dict(_COMMON),
}


def _canonical(name: str, value: Any) -> Any:
    """JSON-friendly option values: dtypes by name, grids as lists of floats."""
    if name == "dtype":
        try:
            dtype = jnp.dtype(value)
        except TypeError:
            dtype = None
        checks.one_of("quantize_layer", "dtype", dtype, checks.HALF_DTYPES)
        return dtype.name
    if name == "grid" and value is not None:
        return [float(a) for a in value]
    return value


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """A mode and its complete options (defaults filled in, JSON-friendly values)."""

    mode: str
    options: Mapping[str, Any]

    @classmethod
    def make(cls, mode: str, options: Mapping[str, Any] | None = None) -> QuantConfig:
        """Validates ``mode`` and the option names, fills in the defaults (ValueError naming the
        unknown option and the allowed ones)."""
        checks.one_of("quantize_layer", "mode", mode, QUANT_MODES)
        defaults = DEFAULT_OPTIONS[mode]
        options = dict(options or {})
        unknown = sorted(set(options) - set(defaults))
        if unknown:
            checks.fail(
                "quantize_layer",
                f"unknown option(s) {unknown} for mode={mode!r}; the options are {sorted(defaults)}",
            )
        merged = {**defaults, **options}
        return cls(mode, {name: _canonical(name, value) for name, value in merged.items()})

    @property
    def needs_hessian(self) -> bool:
        """Whether a GPTQ step needs the calibration Hessian."""
        o = self.options
        return o.get("residual") == "gptq" or o.get("method") == "gptq"

    @property
    def needs_calibration(self) -> bool:
        """Whether any calibration data is read (grid search, GPTQ, unsigned auto-detection)."""
        o = self.options
        return self.needs_hessian or o.get("grid") is not None or o.get("act_format") == "auto"

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, **self.options}

    def __hash__(self) -> int:  # a static attribute of QuantizedLinear: nnx graph definitions hash it
        return hash(json.dumps(self.to_json(), sort_keys=True))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> QuantConfig:
        data = dict(data)
        return cls.make(data.pop("mode"), data)


def quantize_layer(
    w: jax.Array,
    bias: jax.Array | None,
    calib: jax.Array | Calibration | None,
    mode: str | QuantConfig = "svdq-int4",
    **options: Any,
) -> QuantizedWeights:
    """Quantizes ``Y = X·Wᵀ + bias`` in ``mode`` (module docstring for the options).

    Args:
      w: ``(N, K)`` float weights. bias: optional ``(N,)``.
      calib: calibration inputs ``(..., K)`` or a :class:`Calibration`; None only for data-free
        configurations (RTN, no smoothing search, explicit act_format).
      mode: a mode name (with ``options``) or a :class:`QuantConfig`.
    """
    config = mode if isinstance(mode, QuantConfig) else QuantConfig.make(mode, options)
    if isinstance(mode, QuantConfig) and options:
        checks.fail("quantize_layer", "give options either in the QuantConfig or as keywords, not both")
    o = config.options
    dtype = jnp.dtype(o["dtype"])
    if calib is None:
        if config.needs_calibration:
            checks.fail("quantize_layer", f"calib is needed for {config.to_json()}")
    else:
        calib = as_calibration(calib, with_hessian=config.needs_hessian)
    if config.mode in ("nvfp4", "mxfp4"):
        return quantize_fp4(w, bias, fmt=config.mode, dtype=dtype)
    if config.mode == "w4a16":
        checks.one_of("quantize_layer", "method", o["method"], W4A16_METHODS)
        if o["method"] == "rtn":
            if o["act_order"]:
                checks.fail("quantize_layer", "act_order needs method='gptq'")
            return quantize_linear(
                w, bias, mode="w4a16", group_size=o["group_size"], zero_point=o["zero_point"], dtype=dtype
            )
        return gptq(
            w, calib, bias=bias, group_size=o["group_size"], zero_point=o["zero_point"],
            act_order=o["act_order"], block_size=o["block_size"], damp=o["damp"], dtype=dtype,
        )
    act_format = "fp8" if config.mode == "w4a8" else o["act_format"]
    if calib is None:  # data-free: plain RTN with the given activation format
        return quantize_linear(
            w, bias, mode=config.mode, rank=o["rank"], unsigned_activations=act_format == "uint4", dtype=dtype
        )
    return svdquant(
        w, bias, calib, rank=o["rank"], grid=o["grid"], residual=o["residual"], act_format=act_format,
        dtype=dtype, block_size=o["block_size"], damp=o["damp"],
    )


def compare_layer(
    w: jax.Array,
    bias: jax.Array | None,
    calib: jax.Array | Calibration,
    configs: Mapping[str, str | Mapping[str, Any] | QuantConfig],
    *,
    path: str = "",
    chosen: str | None = None,
) -> list[LayerError]:
    """Relative output error ``‖Y_q − Y‖/‖Y‖`` on the calibration sample for each configuration.

    ``configs`` maps a label to a mode name, a ``{"mode": ..., **options}`` dict or a QuantConfig;
    ``chosen`` marks one label as the one in use. Returns one :class:`LayerError` per label.
    """
    calib = as_calibration(calib, with_hessian=any(as_config(c).needs_hessian for c in configs.values()))
    records = []
    for label, spec in configs.items():
        config = as_config(spec)
        weights = quantize_layer(w, bias, calib, config)
        records.append(layer_error(path, label, config, weights, w, bias, calib, chosen=label == chosen))
    return records


def layer_error(
    path: str,
    label: str,
    config: QuantConfig,
    weights: QuantizedWeights,
    w: jax.Array,
    bias: jax.Array | None,
    calib: Calibration,
    *,
    chosen: bool = True,
) -> LayerError:
    """The :class:`LayerError` record of quantized ``weights`` on the calibration sample."""
    return LayerError(
        path=path,
        label=label,
        mode=config.mode,
        rel_error=relative_output_error(weights, w, bias, calib.sample),
        in_features=int(w.shape[1]),
        out_features=int(w.shape[0]),
        tokens=int(calib.sample.shape[0]),
        chosen=chosen,
    )


def as_config(spec: str | Mapping[str, Any] | QuantConfig, *, default_mode: str | None = None,
              base_options: Mapping[str, Any] | None = None) -> QuantConfig:
    """A :class:`QuantConfig` from a mode name, a ``{"mode": ..., **options}`` dict (``mode`` may be
    left out when ``default_mode`` is given) or a QuantConfig; ``base_options`` are applied first, for
    the options the mode has."""
    if isinstance(spec, QuantConfig):
        return spec
    if isinstance(spec, str):
        mode, options = spec, {}
    elif isinstance(spec, Mapping):
        options = dict(spec)
        mode = options.pop("mode", default_mode)
        if mode is None:
            checks.fail("quantize_layer", f"the rule {dict(spec)} names no mode and there is no default_mode")
    else:
        raise ValueError(
            f"jax_w4a4.quantize_layer: a layer spec must be a mode name, a dict with 'mode' and options, "
            f"or None, got {spec!r}"
        )
    checks.one_of("quantize_layer", "mode", mode, QUANT_MODES)
    base = {k: v for k, v in (base_options or {}).items() if k in DEFAULT_OPTIONS[mode]}
    return QuantConfig.make(mode, {**base, **options})

