"""Building an NNX model without random initialisation and filling it from a checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax.numpy as jnp
import numpy as np
from flax import nnx

M = TypeVar("M", bound=nnx.Module)


def new_abstract(constructor: Callable[[], M]) -> M:
    """The module ``constructor()`` builds, with shape-only parameters (nothing is initialised)."""
    return nnx.eval_shape(constructor)


def assign(variable: nnx.Variable, value: np.ndarray, name: str) -> None:
    """Sets a parameter from a checkpoint array, keeping the parameter's dtype.

    Raises:
      ValueError: the checkpoint tensor ``name`` does not have the parameter's shape.
    """
    expected = tuple(variable.get_value().shape)
    if tuple(value.shape) != expected:
        raise ValueError(f"checkpoint tensor {name!r} must have shape {expected}, got {tuple(value.shape)}")
    variable.set_value(jnp.asarray(value, variable.get_value().dtype))
