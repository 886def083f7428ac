"""Support for ``jax.export`` of functions that use jax_w4a4 on CUDA."""

from __future__ import annotations

from jax import export

from jax_w4a4.ops import _library


def export_safety_checks() -> list[export.DisabledSafetyCheck]:
    """The ``disabled_checks`` that let ``jax.export`` serialize our CUDA custom calls.

    jax.export refuses custom-call targets it does not know to be stable; ours are versioned with this
    package, so a serialized function must be loaded with a compatible jax_w4a4. Usage::

        jax.export.export(jax.jit(f), platforms=("cpu", "cuda"),
                          disabled_checks=jax_w4a4.export_safety_checks())(*args)
    """
    return [export.DisabledSafetyCheck.custom_call(_library.target_name(op)) for op in _library.CUDA_KERNELS]
