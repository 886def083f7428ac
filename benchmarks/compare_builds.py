"""A/B of builds of the CUDA library on w4a16_gemm or act_quant: our kernel only, the same cells, each build in its own process.

How kernel variants were compared in benchmarks/NOTES.md: the library loads once per process, so every build times
its cells in a process of its own (JAX_W4A4_LIBRARY names the build), the builds alternate round after round (a
drifting clock or a neighbour on the machine then touches every build alike), and the table gives each cell's
range over the rounds, per build, with the ratio of its median to the first build's. Timing is the benchmarks':
w4a16_gemm as bench_w4a16 (bf16 activations, symmetric g128 weights rotated through sets larger than L2),
act_quant as bench_act_quant (bf16 X, input copies larger than L2), chains of calls timed by the device clock.
Each build's handlers check the workspaces against their own plans, so the ops size them with the planner library
beside the build (libjax_w4a4_budget.so, as CMake puts it beside libjax_w4a4.so; jax_w4a4.budget.library_path),
else with this checkout's: a build with a different planner carries its own.

  python -m benchmarks.compare_builds --build head=build/libjax_w4a4.so --build new=/tmp/new/libjax_w4a4.so \\
      --shapes 28672x8192,8192x8192 --tokens 1,16 --rounds 2
  python -m benchmarks.compare_builds --op act_quant --build head=... --build new=... --shapes 4096x4096,2048x3072 \\
      --rank 32 --formats int4,fp8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks import harness

REPO = Path(__file__).resolve().parent.parent


def parse_build(spec: str) -> tuple[str, Path]:
    """``name=path`` of a build of libjax_w4a4.so."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--build takes name=path/to/libjax_w4a4.so, got {spec!r}")
    return name, Path(path)


def parse_shapes(spec: str) -> list[tuple[int, int]]:
    """``AxB[,AxB...]``: w4a16, the layers' out_features x in_features; act_quant, rows x K."""
    shapes = []
    for item in spec.split(","):
        n, sep, k = item.partition("x")
        if not sep or not n.isdigit() or not k.isdigit():
            raise argparse.ArgumentTypeError(f"--shapes takes AxB[,AxB...], got {item!r}")
        shapes.append((int(n), int(k)))
    return shapes


def parse_tokens(spec: str) -> list[int]:
    """``M[,M...]``: token counts."""
    if not all(item.isdigit() and int(item) > 0 for item in spec.split(",")):
        raise argparse.ArgumentTypeError(f"--tokens takes positive integers M[,M...], got {spec!r}")
    return [int(item) for item in spec.split(",")]


def time_w4a16_cells(shapes: Sequence[tuple[int, int]], tokens: Sequence[int]) -> dict[str, float]:
    """Microseconds per call of every (layer, M) cell of w4a16_gemm with the library this process loaded."""
    import jax.numpy as jnp

    from benchmarks import bench_w4a16

    times = {}
    for n, k in shapes:
        sets = bench_w4a16.weight_sets(n, k)
        for m in tokens:
            times[f"{n}x{k} M={m}"] = 1e6 * bench_w4a16.time_ours(m, k, sets, bench_w4a16.GROUP, jnp.bfloat16)
        del sets
    return times


def time_act_quant_cells(shapes: Sequence[tuple[int, int]], rank: int, formats: Sequence[str]) -> dict[str, float]:
    """Microseconds per call of every (rows x K, format) cell of act_quant with the library this process loaded."""
    from benchmarks import bench_act_quant
    from jax_w4a4 import ops

    times = {}
    for m, k in shapes:
        inputs = bench_act_quant.copies_for(m, k, rank)
        for act_format in formats:
            seconds = bench_act_quant.time_per_call(ops.act_quant, inputs, act_format)
            times[f"{m}x{k} r={rank} {act_format}"] = 1e6 * seconds
        del inputs
    return times


def table_rows(builds: Sequence[str], runs: dict[str, list[dict[str, float]]]) -> list[harness.Row]:
    """One row per cell: each build's min-max over its rounds (µs) and its median against the first build's."""
    rows = []
    for cell in runs[builds[0]][0]:
        values = {name: [run[cell] for run in runs[name]] for name in builds}
        row = harness.Row(cell)
        for name, v in values.items():
            row.cells[f"{name} us"] = f"{min(v):.2f}-{max(v):.2f}" if len(v) > 1 else f"{v[0]:.2f}"
        base = statistics.median(values[builds[0]])
        for name in builds[1:]:
            row.cells[f"{name} / {builds[0]}"] = f"{statistics.median(values[name]) / base:.3f}"
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=parse_build, action="append", required=True,
                        help="name=path of a libjax_w4a4.so build; the first is the baseline (repeatable)")
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("28672x8192,8192x8192"))
    parser.add_argument("--tokens", type=parse_tokens, default=parse_tokens("1,16"))
    parser.add_argument("--op", choices=("w4a16", "act_quant"), default="w4a16")
    parser.add_argument("--rank", type=int, default=32, help="act_quant: the low-rank rank")
    parser.add_argument("--formats", default="int4", help="act_quant: activation formats, comma separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one build's timings, as JSON
    args = parser.parse_args(argv)
    formats = args.formats.split(",")
    if args.op == "act_quant" and not set(formats) <= {"int4", "uint4", "fp8"}:
        parser.error(f"--formats takes int4, uint4 and fp8, got {args.formats!r}")
    if args.worker:
        times = (time_act_quant_cells(args.shapes, args.rank, formats) if args.op == "act_quant"
                 else time_w4a16_cells(args.shapes, args.tokens))
        print(json.dumps(times))
        return
    names = [name for name, _ in args.build]
    if len(set(names)) != len(names):
        parser.error(f"--build names must differ, got {names}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    for name, path in args.build:
        if not path.is_file():
            parser.error(f"--build {name}={path}: no such file")
    shapes = ",".join(f"{n}x{k}" for n, k in args.shapes)
    tokens = ",".join(map(str, args.tokens))
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        for name, path in args.build:
            python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
            env = dict(os.environ, JAX_W4A4_LIBRARY=str(path.resolve()), PYTHONPATH=python_path)
            worker = subprocess.run(
                [sys.executable, __file__, "--worker", "--build", f"{name}={path}", "--shapes", shapes,
                 "--tokens", tokens, "--op", args.op, "--rank", str(args.rank), "--formats", args.formats],
                env=env, capture_output=True, text=True, check=False)
            if worker.returncode != 0:
                sys.exit(f"build {name}, round {round_index + 1}: worker failed\n{worker.stderr[-4000:]}")
            runs[name].append(json.loads(worker.stdout.strip().splitlines()[-1]))
            print(f"round {round_index + 1}, {name}: done", flush=True)
    title = "act_quant, bf16 X" if args.op == "act_quant" else "w4a16_gemm, bf16 g128"
    harness.print_table(f"{title}: µs per call by build (min-max over rounds), median ratio", table_rows(names, runs))


if __name__ == "__main__":
    main()
