"""Shared benchmark machinery: timing (JAX and torch, same process), the two floors, and the table.

How we measure (design §5): median of many timed runs after warm-up, inputs rotated over sets larger
than L2 (60 MB) so the cache does not flatter memory-bound kernels, random data (never zeros).
JAX-level time is what a user sees: R chained calls in one jit, divided by R (dispatch amortized).
Peers (jnp.dot bf16, XLA fp8, torch cuBLAS) are timed in the same process, so ratios are comparable.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

PEAK_FP8_TFLOPS = 1979.0  # H200 dense fp8/int8 datasheet peak: MFU denominator
HBM_BYTES_PER_S = 4.2e12  # measured device-to-device copy bandwidth (peers.md)
L2_BYTES = 60 * 2**20


def rotations(bytes_per_set: int, minimum: int = 2, maximum: int = 8) -> int:
    """How many input sets make the rotation larger than L2 (at least `minimum`)."""
    return int(np.clip(int(np.ceil(2 * L2_BYTES / max(bytes_per_set, 1))), minimum, maximum))


def time_jax(fn: Callable, input_sets: Sequence[tuple], *, calls: int = 20, trials: int = 7) -> float:
    """Median seconds per call of ``fn(*inputs)``, cycling ``input_sets``: the marginal cost of a call.

    Two jitted chains run ``calls`` and ``2 * calls`` calls; the per-call time is the difference of their
    median wall times over ``calls``. One chain's wall time also holds a fixed cost (dispatch of the jit,
    the host waiting for the result: ~0.3-0.5 ms), which divided by ``calls`` inflated short kernels by
    ~16 µs per call (seen by profiling every kernel of a chain with ncu, session 2); the difference
    cancels it, so the number is what the GPU spends per call, launch gaps included.

    Each call's first input passes through an ``optimization_barrier`` together with the previous call's
    output, so the calls run one after another and XLA can neither merge them (its dot merger fuses
    independent dots that share a weight into one GEMM, which would read the weight once for all calls)
    nor drop or hoist them. No loop: a loop's per-iteration control flow would add host round trips.
    """

    def chain_of(length: int):
        @jax.jit
        def chain(input_sets):
            outputs, previous = [], None
            for i in range(length):
                first, *rest = input_sets[i % len(input_sets)]
                if previous is not None:
                    first, _ = jax.lax.optimization_barrier((first, previous))
                previous = fn(first, *rest)
                outputs.append(jax.tree_util.tree_leaves(previous)[0].reshape(-1)[0])
            return jnp.stack(outputs)

        jax.block_until_ready(chain(input_sets))  # compile + warm up
        return chain

    def median_wall(chain) -> float:
        times = []
        for _ in range(trials):
            start = time.perf_counter()
            jax.block_until_ready(chain(input_sets))
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    short, long = chain_of(calls), chain_of(2 * calls)
    return max(median_wall(long) - median_wall(short), 0.0) / calls


def time_torch(fn: Callable[[int], object], n_sets: int, *, calls: int = 50, warmup: int = 10) -> float | None:
    """Median seconds per call of ``fn(i)`` (i cycles over the sets), timed with CUDA events."""
    try:
        import torch
    except ImportError:
        return None
    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    times = []
    for i in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i % n_sets)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return float(np.median(times))


@dataclasses.dataclass
class Row:
    """One measured configuration; `cells` are printed in insertion order."""

    label: str
    cells: dict[str, str] = dataclasses.field(default_factory=dict)


def floors(flops: float, bytes_moved: float) -> tuple[float, float]:
    """(compute floor, memory floor) in seconds: flops at the fp8 peak, bytes at HBM copy bandwidth."""
    return flops / (PEAK_FP8_TFLOPS * 1e12), bytes_moved / HBM_BYTES_PER_S


def fmt_ratio(ours: float | None, peer: float | None) -> str:
    """peer time / our time (> 1 means we are faster), or '-'."""
    return "-" if not ours or not peer else f"{peer / ours:.2f}x"


def print_table(title: str, rows: Sequence[Row]) -> None:
    if not rows:
        return
    headers = ["config", *rows[0].cells]
    table = [[r.label, *r.cells.values()] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *table)]
    print(f"\n## {title}")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for line in table:
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)))
