"""Trace-time argument checks shared by the primitives' abstract evaluation.

Every failure is a ValueError that names the argument, what was expected and what was given, so bad
input never reaches a kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jax import numpy as jnp

HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_RANK = 256
RANK_MULTIPLE = 16


def _dtype_names(dtypes: Sequence) -> str:
    return " or ".join(jnp.dtype(d).name for d in dtypes)


def fail(op: str, message: str) -> None:
    raise ValueError(f"jax_w4a4.{op}: {message}")


def dtype_in(op: str, name: str, value, allowed: Sequence) -> None:
    if jnp.dtype(value.dtype) not in [jnp.dtype(d) for d in allowed]:
        fail(op, f"{name} must have dtype {_dtype_names(allowed)}, got {jnp.dtype(value.dtype).name}")


def shape_is(op: str, name: str, value, expected: tuple[int, ...]) -> None:
    if tuple(value.shape) != tuple(expected):
        fail(op, f"{name} must have shape {tuple(expected)}, got {tuple(value.shape)}")


def ndim_is(op: str, name: str, value, ndim: int) -> None:
    if value.ndim != ndim:
        fail(op, f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")


def multiple_of(op: str, name: str, size: int, multiple: int, why: str = "") -> None:
    if size % multiple:
        fail(op, f"{name} must be a multiple of {multiple}{why}, got {size}")


def one_of(op: str, name: str, value, allowed: Sequence) -> None:
    if value not in allowed:
        fail(op, f"{name} must be one of {tuple(allowed)}, got {value!r}")


def rank(op: str, name: str, r: int) -> None:
    if r % RANK_MULTIPLE or r > MAX_RANK:
        fail(op, f"{name} (the low-rank rank r) must be a multiple of {RANK_MULTIPLE} in [0, {MAX_RANK}], got {r}")


def optional_vector(op: str, name: str, value, n: int, dtypes: Sequence) -> bool:
    """An optional per-column operand: shape (n,) when present, (0,) when absent. Returns presence."""
    if value.shape == (0,):
        return False
    shape_is(op, name, value, (n,))
    dtype_in(op, name, value, dtypes)
    return True


def same_leading_dims(op: str, names: Sequence[str], values: Sequence) -> tuple[int, ...]:
    lead = tuple(values[0].shape[:-1])
    for name, value in zip(names[1:], values[1:]):
        if tuple(value.shape[:-1]) != lead:
            fail(op, f"{name} must have leading dims {lead} like {names[0]}, got {tuple(value.shape[:-1])}")
    return lead


def at_least_1d(op: str, name: str, value) -> None:
    if value.ndim < 1:
        fail(op, f"{name} must have at least one dimension (..., K), got a scalar")


def rows(shape: Sequence[int]) -> int:
    """M: the product of the leading dims."""
    return int(np.prod(shape[:-1], dtype=np.int64))
