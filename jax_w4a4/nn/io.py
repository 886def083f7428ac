"""Checkpoints of quantized models: ``model.safetensors`` (the nnx state flattened by path) and
``quantization.json`` (which layers are quantized, their weights type, static fields and config).

Tensor names are module paths joined with ``/`` (``layers/0/mlp/up/weights/qweight``), as the rules
of :func:`jax_w4a4.nn.quantize_model` see them. Every ``nnx.Variable`` of the model is saved (the
quantized layers' tensors, and the Params of the layers kept in full precision, embeddings, norms...)
except RNG state. Loading rebuilds the quantized layers in a freshly built model of the same
architecture and fills every variable bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from jax_w4a4.formats import svdq_layout, w4a16_layout
from jax_w4a4.nn.linear import QuantizedLinear
from jax_w4a4.nn.model import node_at, path_string, replace_at
from jax_w4a4.quantize.layer import QuantConfig
from jax_w4a4.weights import FakeQuantFP4Weights, SVDQuantWeights, W4A16Weights

M = TypeVar("M", bound=nnx.Module)

FORMAT = "jax_w4a4.nn"
# 2: svdq weight scales in the stage-major kernel layout (formats.svdq_layout.prepack_scales);
# 3: w4a16 scales and zero points in the kernel layout (K/G, N) (formats.w4a16_layout.prepack_scales).
VERSION = 3
READABLE_VERSIONS = (1, 2, VERSION)  # earlier versions are migrated as they load (_migrate)
TENSORS_FILE = "model.safetensors"
CONFIG_FILE = "quantization.json"
WEIGHT_TYPES = {cls.__name__: cls for cls in (SVDQuantWeights, W4A16Weights, FakeQuantFP4Weights)}


def _saved(variable: nnx.Variable) -> bool:
    """RNG state and key arrays are not checkpointed."""
    if isinstance(variable, nnx.RngState):
        return False
    dtype = getattr(variable.get_value(), "dtype", None)
    return dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def _dtype_name(dtype: Any) -> str | None:
    return None if dtype is None else jnp.dtype(dtype).name


def _layer_entry(layer: QuantizedLinear) -> dict[str, Any]:
    weights = layer.quantized_weights
    static = {f.name: getattr(weights, f.name) for f in dataclasses.fields(weights) if f.metadata.get("static")}
    return {
        "weights": type(weights).__name__,
        "static": static,
        "config": None if layer.config is None else layer.config.to_json(),
        "dtype": _dtype_name(layer.dtype),
        "param_dtype": _dtype_name(layer.param_dtype),
    }


def save_quantized(model: nnx.Module, directory: str | os.PathLike) -> None:
    """Writes ``directory/model.safetensors`` and ``directory/quantization.json`` (created if needed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    layers = {
        path_string(path): _layer_entry(node)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, QuantizedLinear)
    }
    tensors = {
        path_string(path): np.asarray(variable.get_value())
        for path, variable in nnx.to_flat_state(nnx.state(model))
        if _saved(variable)
    }
    safetensors.numpy.save_file(tensors, directory / TENSORS_FILE, metadata={"format": FORMAT})
    config = {"format": FORMAT, "version": VERSION, "layers": layers}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _weights_from(name: str, entry: dict[str, Any], tensors: dict[str, np.ndarray]) -> Any:
    cls = WEIGHT_TYPES.get(entry["weights"])
    if cls is None:
        raise ValueError(f"load_quantized: layer {name!r} has unknown weights type {entry['weights']!r}")
    values = {}
    for field in dataclasses.fields(cls):
        if field.metadata.get("static"):  # fields added later (the paddings) default for older files
            values[field.name] = entry["static"].get(field.name, field.default)
        else:
            array = tensors.get(f"{name}/weights/{field.name}")
            values[field.name] = None if array is None else jnp.asarray(array)
    return cls(**values)


def _migrate(config: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
    """Earlier versions stored scales in their logical layouts; the weights now hold the kernels' layouts.
    Version 1: the svdq weight scales ``(N, K/64)`` -> stage-major ``(K/128, N, 2)``
    (:func:`jax_w4a4.formats.svdq_layout.prepack_scales`). Versions 1-2: the w4a16 scales and zero points
    ``(N, K/G)`` -> ``(K/G, N)`` (:func:`jax_w4a4.formats.w4a16_layout.prepack_scales`)."""
    migrations = (  # weights type, the first version with the kernel layout, its fields, the conversion
        (SVDQuantWeights, 2, ("wscales",), svdq_layout.prepack_scales),
        (W4A16Weights, 3, ("scales", "zeros"), w4a16_layout.prepack_scales),
    )
    for name, entry in config["layers"].items():
        for cls, since, fields, to_kernel_layout in migrations:
            if entry["weights"] != cls.__name__ or config["version"] >= since:
                continue
            for field in fields:
                key = f"{name}/weights/{field}"
                if key in tensors:  # absent: an optional field, or a file the checks below reject
                    tensors[key] = np.asarray(to_kernel_layout(tensors[key]))


def load_quantized(model: M, directory: str | os.PathLike) -> M:
    """Loads a checkpoint of :func:`save_quantized` into ``model`` in place and returns it.

    ``model`` is a freshly built, unquantized model of the same architecture (it may be abstract,
    from ``nnx.eval_shape``): the quantized layers replace its ``nnx.Linear`` at the saved paths,
    and every saved variable is filled from the file. Raises ValueError when the file and the model
    disagree (missing or extra tensors, shapes, dtypes). Files of an earlier version are migrated.
    """
    directory = Path(directory)
    config = json.loads((directory / CONFIG_FILE).read_text())
    if config.get("format") != FORMAT or config.get("version") not in READABLE_VERSIONS:
        raise ValueError(
            f"load_quantized: {directory / CONFIG_FILE} is not a {FORMAT} config of version "
            f"{' or '.join(map(str, READABLE_VERSIONS))} (format={config.get('format')!r}, "
            f"version={config.get('version')!r})"
        )
    tensors = safetensors.numpy.load_file(directory / TENSORS_FILE)
    if config["version"] < VERSION:
        _migrate(config, tensors)
    paths = {path_string(path): tuple(path) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)}
    for name, entry in config["layers"].items():
        if name not in paths or not isinstance(node_at(model, paths[name]), (nnx.Linear, QuantizedLinear)):
            raise ValueError(f"load_quantized: the model has no nnx.Linear at {name!r}")
        weights = _weights_from(name, entry, tensors)
        original = node_at(model, paths[name])
        if (original.in_features, original.out_features) != (weights.in_features, weights.out_features):
            raise ValueError(
                f"load_quantized: layer {name!r} is {original.in_features}->{original.out_features} in the "
                f"model but {weights.in_features}->{weights.out_features} in the checkpoint"
            )
        layer = QuantizedLinear(
            weights,
            dtype=None if entry["dtype"] is None else jnp.dtype(entry["dtype"]),
            param_dtype=jnp.dtype(entry["param_dtype"]),
            config=None if entry["config"] is None else QuantConfig.from_json(entry["config"]),
        )
        replace_at(model, paths[name], layer)
    state = nnx.state(model)
    used = set()
    for path, variable in nnx.to_flat_state(state):
        if not _saved(variable):
            continue
        key = path_string(path)
        if key not in tensors:
            raise ValueError(f"load_quantized: the checkpoint has no tensor {key!r}")
        value, expected = tensors[key], variable.get_value()
        if value.shape != tuple(expected.shape) or value.dtype != expected.dtype:
            raise ValueError(
                f"load_quantized: tensor {key!r} is {value.dtype}{value.shape} in the checkpoint, "
                f"the model expects {expected.dtype}{tuple(expected.shape)}"
            )
        variable.set_value(jnp.asarray(value))
        used.add(key)
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"load_quantized: tensors in the checkpoint that the model has no place for: {extra[:10]}")
    nnx.update(model, state)
    return model
