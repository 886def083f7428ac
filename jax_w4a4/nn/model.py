"""``quantize_model``: calibrate, quantize and swap every selected ``nnx.Linear`` of a model in place."""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, MutableMapping, MutableSequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from jax_w4a4.nn.linear import QuantizedLinear, linear_weights
from jax_w4a4.ops import checks
from jax_w4a4.quantize.calibration import DEFAULT_SAMPLE_TOKENS, Calibration
from jax_w4a4.quantize.layer import QuantConfig, as_config, layer_error, quantize_layer
from jax_w4a4.quantize.progress import progress as progress_bar
from jax_w4a4.quantize.report import LayerError

M = TypeVar("M", bound=nnx.Module)
Spec = str | Mapping[str, Any] | QuantConfig | None
Rules = Mapping[str, Spec]
Path = tuple[Any, ...]

KEEP = None  # a rule value that keeps the layer in full precision


def path_string(path: Path) -> str:
    """A module path as rules see it: keys joined with ``/`` (``("layers", 3, "mlp")`` → ``"layers/3/mlp"``)."""
    return "/".join(str(key) for key in path)


def rule_matches(pattern: str, path: str) -> bool:
    """Whether a rule pattern selects ``path``: ``"re:<regex>"`` is searched in the path; anything
    else is a glob matched against the whole path or a trailing part of it that starts after a ``/``."""
    if pattern.startswith("re:"):
        return re.search(pattern[3:], path) is not None
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, "*/" + pattern)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One ``nnx.Linear`` of the model and what to do with it (``config`` None: keep it)."""

    path: Path
    module: nnx.Linear
    config: QuantConfig | None

    @property
    def name(self) -> str:
        return path_string(self.path)


def _default_dtype(module: nnx.Linear) -> str:
    dtype = None if module.dtype is None else jnp.dtype(module.dtype)
    return dtype.name if dtype in checks.HALF_DTYPES else "bfloat16"


def plan_quantization(
    model: nnx.Module,
    rules: Rules | None = None,
    *,
    default_mode: str | None = "svdq-int4",
    default_options: Mapping[str, Any] | None = None,
) -> list[LayerPlan]:
    """Every ``nnx.Linear`` of ``model`` (graph order) with the configuration the rules give it.

    The first rule (in ``rules`` order) whose pattern matches the layer's path decides (see
    :func:`jax_w4a4.nn.quantize_model`); unmatched layers get ``default_mode`` (None: keep). The
    layer's dtype option defaults to the Linear's own ``dtype`` when it is bf16 / fp16, else bf16.
    """
    rules = dict(rules or {})
    for pattern in rules:
        if not isinstance(pattern, str):
            raise ValueError(f"jax_w4a4.quantize_model: rule keys must be path patterns (str), got {pattern!r}")
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as error:
                raise ValueError(
                    f"jax_w4a4.quantize_model: rule {pattern!r} is not a valid regex: {error}"
                ) from None
    used: set[str] = set()
    plans = []
    seen: set[int] = set()
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Linear) or id(node) in seen:
            continue
        seen.add(id(node))
        if not path:
            raise ValueError("jax_w4a4.quantize_model: model is itself an nnx.Linear; wrap it in a Module")
        name = path_string(path)
        spec: Spec = default_mode
        for pattern, rule in rules.items():
            if rule_matches(pattern, name):
                spec = rule
                used.add(pattern)
                break
        base = {"dtype": _default_dtype(node), **(default_options or {})}
        config = None if spec is KEEP else as_config(spec, default_mode=default_mode, base_options=base)
        plans.append(LayerPlan(tuple(path), node, config))
    unused = [pattern for pattern in rules if pattern not in used]
    if unused:
        warnings.warn(f"jax_w4a4.quantize_model: rules matching no nnx.Linear: {unused}", stacklevel=3)
    return plans


def node_at(model: nnx.Module, path: Path) -> Any:
    """The node at ``path`` in the module tree (attributes, list indices or dict keys)."""
    node = model
    for key in path:
        node = node[key] if isinstance(node, (MutableSequence, MutableMapping)) else getattr(node, key)
    return node


def replace_at(model: nnx.Module, path: Path, new: Any) -> None:
    """Puts ``new`` at ``path`` in place of what is there (the parent's attribute or item)."""
    parent, key = node_at(model, path[:-1]), path[-1]
    if isinstance(parent, (MutableSequence, MutableMapping)):
        parent[key] = new
    else:
        setattr(parent, key, new)


class _InputSink:
    """Accumulates the calibration statistics of one layer's inputs."""

    def __init__(self, name: str, with_hessian: bool, max_sample_tokens: int):
        self.name = name
        self.with_hessian = with_hessian
        self.max_sample_tokens = max_sample_tokens
        self.calib: Calibration | None = None

    def add(self, x: jax.Array) -> None:
        if isinstance(x, jax.core.Tracer):
            raise ValueError(
                f"jax_w4a4.quantize_model: layer {self.name!r} got a traced input: calibration runs the "
                "model eagerly, so the forward must not be under jax.jit / nnx.jit or a transform "
                "(pass forward= that calls the model directly)"
            )
        if self.calib is None:
            self.calib = Calibration.empty(
                x.shape[-1], with_hessian=self.with_hessian, max_sample_tokens=self.max_sample_tokens,
                dtype=x.dtype,
            )
        self.calib = self.calib.update(x)


class _Recorder(nnx.Module):
    """Stands in for an ``nnx.Linear`` during calibration: records its inputs, then calls it."""

    def __init__(self, inner: nnx.Linear, sink: _InputSink):
        self.inner = inner
        self.sink = sink

    def __call__(self, inputs: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        self.sink.add(inputs)
        return self.inner(inputs, *args, **kwargs)


def default_forward(model: nnx.Module, batch: Any) -> Any:
    """``model(*batch)`` for a tuple, ``model(**batch)`` for a dict, else ``model(batch)``."""
    if isinstance(batch, tuple):
        return model(*batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(batch)


def quantize_model(
    model: M,
    calibration_batches: Iterable[Any],
    rules: Rules | None = None,
    *,
    default_mode: str | None = "svdq-int4",
    default_options: Mapping[str, Any] | None = None,
    forward: Callable[[M, Any], Any] | None = None,
    layers_per_pass: int | None = None,
    max_sample_tokens: int = DEFAULT_SAMPLE_TOKENS,
    compare: Mapping[str, Spec] | None = None,
    report: list[LayerError] | None = None,
    progress: bool = True,
) -> M:
    """Quantizes the ``nnx.Linear`` layers of ``model`` in place from calibration data; returns it.

    The model runs eagerly on ``calibration_batches`` while each selected Linear records statistics
    of its inputs (:class:`jax_w4a4.quantize.Calibration`: per-channel max, the GPTQ Hessian when a
    GPTQ step needs it, the first ``max_sample_tokens`` tokens); each layer is then quantized with
    :func:`jax_w4a4.quantize.quantize_layer` and replaced by a :class:`QuantizedLinear`.

    Args:
      model: an ``nnx.Module``; its ``nnx.Linear`` layers are found with ``nnx.iter_graph``.
      calibration_batches: the batches (kept in a list: several passes read them again).
      rules: ``{pattern: spec}``, first match wins (see :mod:`jax_w4a4.nn`): spec None keeps the
        layer, a mode name, or ``{"mode": ..., **options}``.
      default_mode: the mode of layers that no rule matches; None keeps them in full precision.
      default_options: options for every quantized layer (those the mode has); rules override them.
      forward: ``forward(model, batch)`` runs one batch (default :func:`default_forward`).
      layers_per_pass: quantize at most this many layers per calibration pass, in graph order; later
        passes then see the already quantized earlier layers (sequential quantization, less memory).
        None: one pass, every layer sees full-precision inputs.
      max_sample_tokens: tokens kept per layer for output-error measurements (smoothing search, report).
      compare: ``{label: spec}`` further configurations whose per-layer errors go into ``report``
        (quantized for the measurement only); a spec without ``mode`` takes the layer's own mode.
      report: a list to which per-layer :class:`jax_w4a4.quantize.LayerError` records are appended
        (the chosen configuration labelled by its mode, then the ``compare`` ones).
      progress: draw progress bars on stderr.

    Raises:
      ValueError: bad rules or options, a selected layer that the calibration never called, or a
        traced input during calibration (the forward must run eagerly).
    """
    if layers_per_pass is not None and layers_per_pass < 1:
        raise ValueError(f"jax_w4a4.quantize_model: layers_per_pass must be ≥ 1 or None, got {layers_per_pass}")
    forward = default_forward if forward is None else forward
    batches = list(calibration_batches)
    if not batches:
        raise ValueError("jax_w4a4.quantize_model: calibration_batches is empty")
    targets = [plan for plan in plan_quantization(
        model, rules, default_mode=default_mode, default_options=default_options
    ) if plan.config is not None]
    chunk = layers_per_pass or max(len(targets), 1)
    passes = -(-len(targets) // chunk)
    for index in range(passes):
        group = targets[index * chunk : (index + 1) * chunk]
        sinks = [_calibrate_sink(plan, compare, max_sample_tokens) for plan in group]
        for plan, sink in zip(group, sinks):
            replace_at(model, plan.path, _Recorder(plan.module, sink))
        try:
            for batch in progress_bar(batches, desc=f"calibration {index + 1}/{passes}", enabled=progress):
                forward(model, batch)
        finally:
            for plan in group:
                replace_at(model, plan.path, plan.module)
        for plan, sink in progress_bar(
            list(zip(group, sinks)), desc=f"quantizing {len(group)} layers", enabled=progress
        ):
            replace_at(model, plan.path, _quantize_one(plan, sink, compare, report))
    return model


def _calibrate_sink(plan: LayerPlan, compare: Mapping[str, Spec] | None, max_sample_tokens: int) -> _InputSink:
    configs = [plan.config, *(_compare_configs(plan, compare).values())]
    return _InputSink(plan.name, any(c.needs_hessian for c in configs), max_sample_tokens)


def _compare_configs(plan: LayerPlan, compare: Mapping[str, Spec] | None) -> dict[str, QuantConfig]:
    base = {"dtype": plan.config.options["dtype"]}
    return {
        label: as_config(spec, default_mode=plan.config.mode, base_options=base)
        for label, spec in (compare or {}).items()
    }


def _quantize_one(
    plan: LayerPlan, sink: _InputSink, compare: Mapping[str, Spec] | None, report: list[LayerError] | None
) -> QuantizedLinear:
    if sink.calib is None:
        raise ValueError(
            f"jax_w4a4.quantize_model: layer {plan.name!r} was not called by the calibration forward; "
            f"add the rule {{{plan.name!r}: None}} to keep it in full precision"
        )
    w, bias = linear_weights(plan.module)
    weights = quantize_layer(w, bias, sink.calib, plan.config)
    if report is not None:
        report.append(layer_error(plan.name, plan.config.mode, plan.config, weights, w, bias, sink.calib))
        for label, config in _compare_configs(plan, compare).items():
            other = quantize_layer(w, bias, sink.calib, config)
            report.append(layer_error(plan.name, label, config, other, w, bias, sink.calib, chosen=False))
    return QuantizedLinear(weights, dtype=plan.module.dtype, param_dtype=plan.module.param_dtype, config=plan.config)
