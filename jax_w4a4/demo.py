"""The main job for now: quantize one linear layer in every mode, run it under jit, report the error.

    python -m jax_w4a4.demo [--tokens 256] [--in-features 2048] [--out-features 2048]

On a GPU the CUDA kernels run where jax_w4a4 has them; elsewhere the reference path runs.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_w4a4
from jax_w4a4.ops import _library

CONFIGS = (
    ("svdq-int4 RTN (r=0)", dict(mode="svdq-int4", rank=0)),
    ("svdq-int4 (r=32)", dict(mode="svdq-int4", rank=32)),
    ("w4a8 (r=32)", dict(mode="w4a8", rank=32)),
    ("w4a16 g128", dict(mode="w4a16", group_size=128)),
    ("w4a16 g128 zero-point", dict(mode="w4a16", group_size=128, zero_point=True)),
)


def synthetic_layer(rng: np.random.Generator, n: int, k: int) -> tuple[jax.Array, jax.Array]:
    """A weight with a decaying spectrum and outlier input channels (what SVDQuant is built for)."""
    spectrum = 1.0 / (1.0 + np.arange(64))
    low_rank = (rng.standard_normal((n, 64)) * spectrum) @ rng.standard_normal((64, k))
    w = 0.02 * rng.standard_normal((n, k)) + 0.02 * low_rank
    w[:, rng.choice(k, 8, replace=False)] *= 6
    return jnp.asarray(w, jnp.float32), jnp.asarray(0.1 * rng.standard_normal(n), jnp.float32)


def _time(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--in-features", type=int, default=2048)
    parser.add_argument("--out-features", type=int, default=2048)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    w, bias = synthetic_layer(rng, args.out_features, args.in_features)
    x_np = rng.standard_normal((args.tokens, args.in_features))
    x_np[:, rng.choice(args.in_features, 4, replace=False)] *= 15
    x = jnp.asarray(x_np, jnp.bfloat16)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T + np.asarray(bias, np.float64)

    backend = jax.default_backend()
    kernels = sorted(_library.register_cuda_targets()) if backend == "gpu" else []
    print(f"jax_w4a4 {jax_w4a4.__version__} on {backend} ({jax.devices()[0].device_kind}); "
          f"CUDA kernels: {', '.join(kernels) or 'none (reference path)'}")
    print(f"layer: X ({args.tokens}, {args.in_features}) bf16 · W ({args.out_features}, {args.in_features})ᵀ + bias\n")
    print(f"{'mode':<24} {'rel. error vs fp64':>18} {'ms / call':>10}")
    bf16 = jax.jit(lambda x, w, b: (x @ w.T.astype(x.dtype) + b.astype(x.dtype)))
    for name, kwargs in (("bf16 (unquantized)", None), *CONFIGS):
        if kwargs is None:
            fn, fn_args = bf16, (x, w, bias)
        else:
            weights = jax_w4a4.quantize_linear(w, bias, **kwargs)
            fn, fn_args = jax.jit(jax_w4a4.linear), (x, weights)
        y = np.asarray(fn(*fn_args), np.float64)
        err = np.linalg.norm(y - exact) / np.linalg.norm(exact)
        print(f"{name:<24} {err:>18.4f} {_time(fn, *fn_args) * 1e3:>10.2f}")


if __name__ == "__main__":
    main()
