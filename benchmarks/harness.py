"""Shared benchmark machinery: timing (JAX and torch, same process), the two floors, and the table.

How we measure (design §5): median of many timed runs after warm-up, inputs rotated over sets larger
than L2 (60 MB) so the cache does not flatter memory-bound kernels, random data (never zeros).
JAX-level time: R chained calls in one jit, timed on the GPU by the library's device clock (time_jax),
divided by R: what the GPU spends per call inside a user's jit, comparable with the torch peers' CUDA
events.
Peers (jnp.dot bf16, XLA fp8, torch cuBLAS) are timed in the same process, so ratios are comparable.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_w4a4.ops import _library

PEAK_FP8_TFLOPS = 1979.0  # H200 dense fp8/int8 datasheet peak: MFU denominator
HBM_BYTES_PER_S = 4.2e12  # measured device-to-device copy bandwidth (peers.md)
L2_BYTES = 60 * 2**20


def rotations(bytes_per_set: int, minimum: int = 2, maximum: int = 8) -> int:
    """How many input sets make the rotation larger than L2 (at least `minimum`)."""
    return int(np.clip(int(np.ceil(2 * L2_BYTES / max(bytes_per_set, 1))), minimum, maximum))


def time_jax(fn: Callable, input_sets: Sequence[tuple], *, calls: int = 20, trials: int = 7) -> float:
    """Median seconds per call of ``fn(*inputs)`` in a jitted chain of calls, cycling ``input_sets``.

    On a GPU the chain is timed on the GPU itself: the library's device clock (a one-thread kernel that
    reads %globaltimer) runs before the first call and after the last, in the same stream, so the time
    per call is what the GPU spends per call, launch gaps included, with neither the host's dispatch
    nor its wait for the result in it (the comparable of the torch peers' CUDA events). Without the
    clock (no library, or a CPU) it is the marginal cost from chains of ``calls`` and ``2 * calls`` calls:
    the difference of their median wall times over ``calls``, which cancels the jit's fixed dispatch and
    sync cost (~0.3-0.5 ms) but is noisy (±10-20% on one row), as session 2's tables showed.

    Each call's first input passes through an ``optimization_barrier`` together with the previous call's
    output, so the calls run one after another and XLA can neither merge them (its dot merger fuses
    independent dots that share a weight into one GEMM, which would read the weight once for all calls)
    nor drop or hoist them. Give every call its own first input (an activation copy per call, as
    bench_w4a4 and bench_w4a16 do): with the weights first and one activation closed over as a constant,
    XLA still merged or deduplicated 1-token jnp.dot calls (Triton GEMV fusions, session 13). No loop: a
    loop's per-iteration control flow would add host round trips.
    """
    if _library.register_tool_target(DEVICE_CLOCK):
        return _time_on_device(fn, input_sets, calls=calls, trials=trials)
    short, long = _chain(fn, input_sets, calls), _chain(fn, input_sets, 2 * calls)
    return max(_median_wall(long, input_sets, trials) - _median_wall(short, input_sets, trials), 0.0) / calls


def _chain(fn: Callable, input_sets: Sequence[tuple], length: int, clock: Callable | None = None):
    """A jitted chain of ``length`` calls, warmed up; with ``clock``, also the GPU time before and after."""

    @jax.jit
    def chain(input_sets):
        outputs = []
        previous = start = clock(jax.tree_util.tree_leaves(input_sets[0])[0]) if clock else None
        for i in range(length):
            first, *rest = input_sets[i % len(input_sets)]
            if previous is not None:
                first, _ = jax.lax.optimization_barrier((first, previous))
            previous = fn(first, *rest)
            outputs.append(jax.tree_util.tree_leaves(previous)[0].reshape(-1)[0])
        stacked = jnp.stack(outputs)
        return (stacked, start, clock(stacked)) if clock else stacked

    jax.block_until_ready(chain(input_sets))  # compile + warm up
    return chain


def _median_wall(chain, input_sets: Sequence[tuple], trials: int) -> float:
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        jax.block_until_ready(chain(input_sets))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


DEVICE_CLOCK = "jax_w4a4_device_clock"


def jax_timing() -> str:
    """How time_jax times in this process, for the benchmark headers."""
    if _library.register_tool_target(DEVICE_CLOCK):
        return "JAX-level times: chains of calls in one jit, timed on the GPU (device clock)"
    return "JAX-level times: marginal host wall time of chains of calls (no device clock)"


def _device_clock(after: jax.Array) -> jax.Array:
    """The GPU's global timer (ns, as uint32 [low, high]) once ``after`` is computed."""
    return jax.ffi.ffi_call(DEVICE_CLOCK, jax.ShapeDtypeStruct((2,), jnp.uint32))(after)


STREAM_PEER = "jax_w4a4_stream_peer"


def stream_peer(x: jax.Array) -> jax.Array:
    """A plain kernel moving act_quant's main bytes (csrc/kernels/stream_peer.cu): reads ``x`` (bf16 /
    fp16, 2 bytes a value) and writes the high byte of each value (1 byte a value, as act_quant's q codes).
    Needs the library on a GPU: ``_library.register_tool_target(STREAM_PEER)`` says whether it is there."""
    return jax.ffi.ffi_call(STREAM_PEER, jax.ShapeDtypeStruct(x.shape, jnp.uint8))(x)


def _time_on_device(fn: Callable, input_sets: Sequence[tuple], *, calls: int, trials: int) -> float:
    chain = _chain(fn, input_sets, calls, clock=_device_clock)
    times = []
    for _ in range(trials):
        _, start, end = jax.device_get(chain(input_sets))
        ns = (int(end[1]) << 32 | int(end[0])) - (int(start[1]) << 32 | int(start[0]))
        times.append(ns * 1e-9 / calls)
    return float(np.median(times))


def time_torch(fn: Callable[[int], object], n_sets: int, *, calls: int = 20, trials: int = 7, warmup: int = 10) -> float | None:
    """Median seconds per call of ``fn(i)`` (i cycles over the sets), timed with CUDA events.

    Like ``time_jax``: ``calls`` back-to-back calls between two events, so the GPU never idles waiting for
    the host's next launch (timing each call alone after a synchronize would count the launch latency into
    the peer and flatter our ratios), then the median over ``trials`` such chains.
    """
    try:
        import torch
    except ImportError:
        return None
    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    times = []
    for trial in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn((trial * calls + i) % n_sets)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / calls)
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
