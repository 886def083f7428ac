"""Statistics of a linear layer's calibration inputs, accumulated batch by batch.

Every calibration-based algorithm reads its inputs through :class:`Calibration`: SVDQuant smoothing
needs the per-channel ``max|X|`` over all tokens, GPTQ the Hessian ``H = 2 XᵀX / n``, the unsigned
activation mode the minimum, and the output-error objective (smoothing grid search, reports) a sample
of real tokens. Accumulating these instead of keeping every token keeps memory at ``O(K²)`` per
layer whatever the number of calibration tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_w4a4.reference import HIGHEST

DEFAULT_SAMPLE_TOKENS = 1024


@functools.partial(jax.jit, static_argnames=("with_xtx",))
def _batch_stats(x: jax.Array, *, with_xtx: bool) -> tuple[jax.Array | None, jax.Array, jax.Array]:
    x = x.astype(jnp.float32)
    xtx = jnp.einsum("tk,tl->kl", x, x, precision=HIGHEST) if with_xtx else None
    return xtx, jnp.max(jnp.abs(x), axis=0), jnp.min(x)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Calibration statistics of one layer's inputs ``X (tokens, K)``.

    Attributes:
      xtx: ``(K, K)`` fp32 ``Σ xᵀx`` over all tokens, or None when not collected (no GPTQ).
      absmax: ``(K,)`` fp32 ``max |X|`` per input channel over all tokens.
      minimum: the smallest input value (≥ 0 means the inputs suit unsigned activations).
      count: the number of tokens seen.
      sample: ``(T, K)`` the first ``T ≤ max_sample_tokens`` tokens, in the inputs' dtype (used to
        measure output errors).
      max_sample_tokens: how many tokens ``sample`` keeps.
    """

    xtx: jax.Array | None
    absmax: jax.Array
    minimum: float
    count: int
    sample: jax.Array
    max_sample_tokens: int = DEFAULT_SAMPLE_TOKENS

    @property
    def in_features(self) -> int:
        return int(self.absmax.shape[0])

    @classmethod
    def empty(
        cls, in_features: int, *, with_hessian: bool = True, max_sample_tokens: int = DEFAULT_SAMPLE_TOKENS,
        dtype: jnp.dtype = jnp.float32,
    ) -> Calibration:
        """No tokens yet; :meth:`update` adds batches."""
        if max_sample_tokens < 1:
            raise ValueError(f"max_sample_tokens must be ≥ 1, got {max_sample_tokens}")
        k = in_features
        return cls(
            xtx=jnp.zeros((k, k), jnp.float32) if with_hessian else None,
            absmax=jnp.zeros((k,), jnp.float32),
            minimum=float("inf"),
            count=0,
            sample=jnp.zeros((0, k), dtype),
            max_sample_tokens=max_sample_tokens,
        )

    @classmethod
    def from_activations(
        cls, x: jax.Array, *, with_hessian: bool = True, max_sample_tokens: int | None = None
    ) -> Calibration:
        """Statistics of ``x (..., K)`` (all leading dims are tokens); the sample keeps every token
        unless ``max_sample_tokens`` is given."""
        x = jnp.asarray(x)
        if x.ndim < 1 or x.shape[-1] == 0:
            raise ValueError(f"calibration activations must be (..., K) with K > 0, got shape {tuple(x.shape)}")
        tokens = int(np.prod(x.shape[:-1], dtype=np.int64))
        limit = max(tokens, 1) if max_sample_tokens is None else max_sample_tokens
        empty = cls.empty(x.shape[-1], with_hessian=with_hessian, max_sample_tokens=limit, dtype=x.dtype)
        return empty.update(x)

    def update(self, x: jax.Array) -> Calibration:
        """Adds a batch ``x (..., K)`` of inputs; returns the new statistics."""
        x = jnp.asarray(x)
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"calibration batch must have shape (..., {self.in_features}), got {tuple(x.shape)}"
            )
        x = x.reshape(-1, self.in_features)
        if x.shape[0] == 0:
            return self
        xtx, absmax, minimum = _batch_stats(x, with_xtx=self.xtx is not None)
        room = self.max_sample_tokens - self.sample.shape[0]
        sample = self.sample
        if room > 0:
            sample = jnp.concatenate([sample.astype(x.dtype), x[:room]], axis=0)
        return dataclasses.replace(
            self,
            xtx=None if xtx is None else self.xtx + xtx,
            absmax=jnp.maximum(self.absmax, absmax),
            minimum=min(self.minimum, float(minimum)),
            count=self.count + int(x.shape[0]),
            sample=sample,
        )

    def hessian(self) -> jax.Array:
        """``H = 2 XᵀX / n`` (fp32 ``(K, K)``), the GPTQ proxy Hessian of the layer's squared error."""
        if self.xtx is None:
            raise ValueError("this Calibration was collected without the Hessian (with_hessian=False)")
        if self.count == 0:
            raise ValueError("this Calibration has seen no tokens")
        return self.xtx * (2.0 / self.count)

    @property
    def non_negative(self) -> bool:
        """Whether every calibration input was ≥ 0 (the unsigned uint4 activation mode applies)."""
        return self.count > 0 and self.minimum >= 0.0


def as_calibration(calib: jax.Array | Calibration, *, with_hessian: bool = True) -> Calibration:
    """``calib`` itself, or the statistics of raw activations ``(..., K)``."""
    if isinstance(calib, Calibration):
        if calib.count == 0:
            raise ValueError("calib has seen no tokens (Calibration.update adds batches)")
        return calib
    return Calibration.from_activations(calib, with_hessian=with_hessian)
