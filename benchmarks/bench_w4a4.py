"""Benchmark of the sm90 W4A4 GEMM (csrc/kernels/sm90/w4a4_gemm.cu) with its peers, measured in one process.

    python benchmarks/bench_w4a4.py [--quick]

Prefill shapes (M x N x K, low-rank rank 32): kernel time, TFLOPS (2MNK; the low-rank flops are shown
apart), MFU against the 1979 TFLOPS dense fp8 peak, and the ratio to jnp.dot bf16, the XLA fp8 dot, and,
when torch is importable, torch cuBLAS bf16 and torch._scaled_mm fp8 (rowwise scales). Decode shapes
(M in {1, 16, 64} at N x K 28672 x 8192 and 8192 x 8192): time in µs, GB/s of the bytes the kernel must
move, and the same ratios. Floors to aim for: >= 1.3x cuBLAS bf16 at 8192^3 (~1023 TFLOPS) and <= 49 µs
(2.5x bf16) at M <= 16 on 28672 x 8192.

Both tables also time the whole W4A4 linear a user runs (`jax_w4a4.linear`, i.e. `ops.w4a4_linear`: act_quant
of the bf16 input, then the GEMM, launched by one FFI call so that the GEMM's CTAs start and set up while
act_quant runs) and its ratio to torch cuBLAS bf16 (or jnp.dot bf16 without torch).

Timing: one jitted function runs R calls, each on its own activation copy (so XLA cannot merge them) and
cycling over enough weight copies that the weights are not L2-resident across calls; the per-call time is
the median over several runs of wall time / R (dispatch is amortised over R calls). torch peers are timed
with CUDA events the same way.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave memory for the torch peers

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import harness  # noqa: E402
from jax_w4a4 import ops  # noqa: E402
from jax_w4a4.formats import svdq, svdq_layout  # noqa: E402

PEAK_FP8_TFLOPS = 1979.0
L2_BYTES = 60 << 20
RANK = 32
PREFILL = [(8192, 8192, 8192), (4096, 3072, 3072), (4096, 12288, 3072), (4096, 3072, 12288), (2048, 4096, 4096)]
DECODE = [(m, n, k) for n, k in [(28672, 8192), (8192, 8192)] for m in (1, 16, 64)]
DTYPE = jnp.bfloat16
LINEAR = "w4a4 linear"  # act_quant + the GEMM, as jax_w4a4.linear runs them

try:
    import torch
except ImportError:  # the peers that need torch are skipped
    torch = None


def _weight_copies(weight_bytes: int) -> int:
    """Distinct weight copies so a copy is evicted from L2 before it is used again."""
    return 1 if weight_bytes > 2 * L2_BYTES else int(np.ceil(3 * L2_BYTES / weight_bytes))


def _time_jax(fn, activations, weights, repeats: int) -> float:
    """fn(activation_args, weight_args) once per activation copy, weights cycled; seconds per call."""
    sets = [(a, weights[i % len(weights)]) for i, a in enumerate(activations)]
    return harness.time_jax(fn, sets, calls=len(sets), trials=repeats)


def _time_torch(fn, activations, weights, repeats: int) -> float:
    n = len(activations)
    return harness.time_torch(lambda i: fn(activations[i % n], weights[i % len(weights)]), n, calls=n, trials=repeats)


def _w4a4_inputs(m, n, k, copies, weight_copies, key):
    """bf16 input copies and weight copies (λ, L_down, prepacked, scales, L_up, α, β)."""
    keys = jax.random.split(key, copies + weight_copies)
    xs = [jax.random.normal(keys[i], (m, k), DTYPE) for i in range(copies)]
    weights = []
    for i in range(weight_copies):
        kw, ku, ka, kb, ks, kd = jax.random.split(keys[copies + i], 6)
        smooth = jax.random.uniform(ks, (k,), jnp.float32, 0.5, 2.0)
        lora_down = (jax.random.normal(kd, (k, RANK)) / np.sqrt(k)).astype(DTYPE)
        qweight, wscales = jax.jit(svdq.quantize_weights, static_argnames="scale_dtype")(
            jax.random.normal(kw, (n, k)) / np.sqrt(k), scale_dtype=DTYPE)
        lora_up = (jax.random.normal(ku, (RANK, n)) / np.sqrt(RANK)).astype(DTYPE)
        alpha = jax.random.uniform(ka, (n,), jnp.float32, 0.5, 1.5)
        bias = jax.random.normal(kb, (n,)).astype(DTYPE)
        weights.append((smooth, lora_down, jax.jit(svdq_layout.prepack)(qweight),
                        jax.jit(svdq_layout.prepack_scales)(wscales), lora_up, alpha, bias))
    return xs, weights


def _act_quant(x, ws):
    smooth, lora_down = ws[:2]
    return ops.act_quant(x, smooth, lora_down, act_format="int4")


def _w4a4(acts, ws):
    q_x, s_x, la = acts
    prepacked, wscales, lora_up, alpha, bias = ws[2:]
    return ops.w4a4_gemm(q_x, s_x, la, prepacked, wscales, lora_up, alpha, bias, act_format="int4")


def _w4a4_linear(x, ws):
    smooth, lora_down, prepacked, wscales, lora_up, alpha, bias = ws
    return ops.w4a4_linear(x, smooth, lora_down, prepacked, wscales, lora_up, alpha, bias, act_format="int4")


def _bf16_dot(x, w_kn):
    return jnp.dot(x, w_kn)


def _fp8_dot(x8, w8):
    return jax.lax.dot_general(x8, w8, (((1,), (1,)), ((), ())), preferred_element_type=DTYPE)


def _measure(m, n, k, calls, repeats, key):
    """Per-call seconds of the GEMM, of the whole linear (LINEAR) and of each peer (None where unavailable)."""
    results = {}
    w4_bytes = n * k // 2
    try:
        xs, weights = _w4a4_inputs(m, n, k, calls, _weight_copies(w4_bytes), key)
        quantize = jax.jit(_act_quant)
        acts = [quantize(x, weights[i % len(weights)]) for i, x in enumerate(xs)]
        results["w4a4"] = _time_jax(_w4a4, acts, weights, repeats)
        del acts
        results[LINEAR] = _time_jax(_w4a4_linear, xs, weights, repeats)
        del xs, weights
    except Exception as error:  # noqa: BLE001 (a missing or failing kernel must not hide the peers)
        print(f"  w4a4 {m}x{n}x{k}: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
        results["w4a4"] = results[LINEAR] = None

    kx, kw = jax.random.split(key)
    xs = [jax.random.normal(jax.random.fold_in(kx, i), (m, k), DTYPE) for i in range(calls)]
    ws = [jax.random.normal(jax.random.fold_in(kw, i), (k, n), DTYPE) for i in range(_weight_copies(2 * n * k))]
    results["jnp bf16"] = _time_jax(_bf16_dot, xs, ws, repeats)
    x8 = [x.astype(jnp.float8_e4m3fn) for x in xs]
    w8 = [w.T.astype(jnp.float8_e4m3fn) for w in ws[: _weight_copies(n * k)]]
    del xs, ws
    results["XLA fp8"] = _time_jax(_fp8_dot, x8, w8, repeats)
    del x8, w8

    results["torch bf16"] = results["torch fp8"] = None
    if torch is not None and torch.cuda.is_available():
        txs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(calls)]
        tws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(_weight_copies(2 * n * k))]
        results["torch bf16"] = _time_torch(lambda a, w: torch.mm(a, w.t()), txs, tws, repeats)
        try:
            ta8 = [(a.to(torch.float8_e4m3fn), torch.ones(m, 1, device="cuda")) for a in txs]
            tw8 = [(w.to(torch.float8_e4m3fn), torch.ones(1, n, device="cuda")) for w in tws[: _weight_copies(n * k)]]
            scaled = lambda a, w: torch._scaled_mm(  # noqa: E731
                a[0], w[0].t(), scale_a=a[1], scale_b=w[1], out_dtype=torch.bfloat16)
            results["torch fp8"] = _time_torch(scaled, ta8, tw8, repeats)
        except Exception as error:  # noqa: BLE001 (rowwise fp8 needs recent torch and 16-aligned shapes)
            print(f"  torch._scaled_mm {m}x{n}x{k}: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
        del txs, tws
        torch.cuda.empty_cache()
    return results


def _ratios(results):
    kernel = results["w4a4"]
    peers = [name for name in results if name not in ("w4a4", LINEAR)]
    if kernel is None:
        return "  ".join(f"{name} {results[name] * 1e6:9.1f} µs" for name in peers if results[name] is not None)
    return "  ".join(
        f"x{results[name] / kernel:4.2f} vs {name}" if results[name] is not None else f"  n/a  {name}"
        for name in peers)


def _linear_column(results):
    """The whole linear's µs and its ratio to torch cuBLAS bf16 (jnp.dot bf16 without torch)."""
    linear = results[LINEAR]
    if linear is None:
        return f"{'-':>9} {'-':>6}"
    peer = results["torch bf16"] or results["jnp bf16"]
    return f"{linear * 1e6:9.1f} x{peer / linear:5.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument("--only", choices=("prefill", "decode"), help="run one of the two tables")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    print(f"w4a4_gemm sm90 on {jax.devices()[0].device_kind}; torch {'absent' if torch is None else torch.__version__}")
    print(harness.jax_timing())
    key = jax.random.key(0)

    prefill = [] if args.only == "decode" else PREFILL
    decode = [] if args.only == "prefill" else DECODE
    print(f"\nprefill (rank {RANK}, int4 activations, bf16 out)")
    print(f"  {'M x N x K':>20} {'µs':>9} {'TFLOPS':>7} {'MFU':>6} {'low-rank TF':>11} {'linear µs':>9} "
          f"{'vs bf16':>6}   GEMM ratios (peer time / kernel time)")
    for m, n, k in prefill:
        results = _measure(m, n, k, calls=8, repeats=repeats, key=jax.random.fold_in(key, m * n + k))
        t = results["w4a4"]
        shape = f"{m} x {n} x {k}"
        if t is None:
            print(f"  {shape:>20} {'-':>9} {'-':>7} {'-':>6} {'-':>11} {_linear_column(results)}   {_ratios(results)}")
            continue
        tflops = 2 * m * n * k / t / 1e12
        lowrank = 2 * m * n * RANK / t / 1e12
        print(f"  {shape:>20} {t * 1e6:9.1f} {tflops:7.0f} {tflops / PEAK_FP8_TFLOPS:6.1%} {lowrank:11.1f} "
              f"{_linear_column(results)}   {_ratios(results)}")

    print(f"\ndecode (rank {RANK}, int4 activations, bf16 out)")
    print(f"  {'M x N x K':>20} {'µs':>9} {'GB/s':>7} {'linear µs':>9} {'vs bf16':>6}   "
          "GEMM ratios (peer time / kernel time)")
    for m, n, k in decode:
        results = _measure(m, n, k, calls=16, repeats=repeats, key=jax.random.fold_in(key, m * n + k))
        t = results["w4a4"]
        shape = f"{m} x {n} x {k}"
        if t is None:
            print(f"  {shape:>20} {'-':>9} {'-':>7} {_linear_column(results)}   {_ratios(results)}")
            continue
        moved = (n * k // 2 + n * (k // 64) * 2 + m * k + m * (k // 64) * 2 + m * n * 2 + RANK * n * 2 +
                 m * RANK * 4 + n * 6)
        print(f"  {shape:>20} {t * 1e6:9.1f} {moved / t / 1e9:7.0f} {_linear_column(results)}   {_ratios(results)}")


if __name__ == "__main__":
    main()
