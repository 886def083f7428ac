"""Relative output error of quantized layers on calibration data, as records and a printable table."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jax_w4a4.linear import linear
from jax_w4a4.reference import HIGHEST
from jax_w4a4.weights import QuantizedWeights


def reference_output(x: jax.Array, w: jax.Array, bias: jax.Array | None) -> jax.Array:
    """``X·Wᵀ + bias`` in fp32 (``x (..., K)``, ``w (N, K)``), the full-precision output."""
    y = jnp.einsum("...k,nk->...n", x.astype(jnp.float32), w.astype(jnp.float32), precision=HIGHEST)
    return y if bias is None else y + bias.astype(jnp.float32)


def squared_error(y: jax.Array, y_ref: jax.Array) -> jax.Array:
    """``‖y − y_ref‖²`` in fp32, ``y`` taken as rounded to its dtype.

    The barrier keeps XLA (``xla_allow_excess_precision``) from fusing the layer's final rounding to
    bf16/fp16 away when ``y`` is only consumed in fp32 inside a jit.
    """
    return jnp.sum(jnp.square(lax.optimization_barrier(y).astype(jnp.float32) - y_ref))


def layer_input(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``x`` in the layer's dtype, cast *outside* any jit: inside one, XLA on CPU may drop an
    f32 → bf16 → f32 round trip (``xla_allow_excess_precision``), so the quantized layer would see
    unrounded inputs that it never sees in a model."""
    return jax.device_put(jnp.asarray(x).astype(dtype))


@jax.jit
def _relative_error(weights: QuantizedWeights, w: jax.Array, bias: jax.Array | None, x: jax.Array) -> jax.Array:
    y_ref = reference_output(x, w, bias)
    return jnp.sqrt(squared_error(linear(x, weights), y_ref) / jnp.sum(jnp.square(y_ref)))


def relative_output_error(
    weights: QuantizedWeights, w: jax.Array, bias: jax.Array | None, x: jax.Array
) -> float:
    """``‖Y_q − Y‖ / ‖Y‖`` on inputs ``x (..., K)``.

    ``Y_q = linear(x, weights)`` with x cast to the layer's dtype, ``Y = x·Wᵀ + bias`` in fp32 from the
    same (cast) x, so only the quantization error is measured.
    """
    return float(_relative_error(weights, jnp.asarray(w), bias, layer_input(x, weights.dtype)))


@dataclasses.dataclass(frozen=True)
class LayerError:
    """One layer quantized one way: ``rel_error = ‖Y_q − Y‖ / ‖Y‖`` on its calibration sample.

    ``label`` names the configuration (the mode, or a user label when comparing several);
    ``chosen`` marks the configuration the model actually uses.
    """

    path: str
    label: str
    mode: str
    rel_error: float
    in_features: int
    out_features: int
    tokens: int
    chosen: bool = True


def format_report(records: Sequence[LayerError], *, digits: int = 4) -> str:
    """A table with one row per layer and one column per label; the chosen one is marked with ``*``
    (and wins its cell over a comparison record with the same label).

    A last row gives the mean relative error of each column over the layers it covers.
    """
    if not records:
        return "(no quantized layers)"
    labels = list(dict.fromkeys(r.label for r in records))
    paths = list(dict.fromkeys(r.path for r in records))
    cells: dict[tuple[str, str], LayerError] = {}
    for r in records:  # a chosen record wins its cell over a comparison with the same label
        if (r.path, r.label) not in cells or r.chosen:
            cells[(r.path, r.label)] = r
    shapes = {r.path: f"{r.out_features}x{r.in_features}" for r in records}
    width = max(digits + 3, *(len(label) for label in labels)) + 1  # + the chosen mark
    path_width = max(len("layer"), len("mean"), *(len(p) for p in paths))

    def row(name: str, shape: str, texts: list[str]) -> str:
        return f"{name:<{path_width}}  {shape:>11}  " + "  ".join(f"{t:>{width}}" for t in texts)

    header = row("layer", "N x K", [f"{label} " for label in labels])
    lines = [header, "-" * len(header)]
    for path in paths:
        texts = []
        for label in labels:
            record = cells.get((path, label))
            mark = "*" if record is not None and record.chosen else " "
            texts.append("" if record is None else f"{record.rel_error:.{digits}f}{mark}")
        lines.append(row(path, shapes[path], texts))
    means = []
    for label in labels:
        values = [r.rel_error for (_, cell_label), r in cells.items() if cell_label == label]
        means.append(f"{sum(values) / len(values):.{digits}f} ")
    lines += ["-" * len(header), row("mean", "", means)]
    return "\n".join(lines)


def print_report(records: Sequence[LayerError], *, digits: int = 4) -> None:
    """Prints :func:`format_report`."""
    print(format_report(records, digits=digits))
