"""The real models (MiniLM encoder, SmolLM2 decoder), their tokenizers and the text corpus.

Each NNX model is checked against an independent float64 NumPy forward written here from the raw
checkpoint tensors. The NumPy decoder keeps the GGUF file's row order and applies llama.cpp's
interleaved RoPE, while the NNX model un-permutes q/k to the Hugging Face layout and rotates halves:
agreement checks the loader's permutation too.
"""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file
from scipy.special import erf

from jax_w4a4.models import bert, llama, text

_embed = nnx.jit(lambda model, ids, mask: model.embed(ids, mask))

# ----------------------------------------------------------------------------- text corpus


def test_text_extractor_keeps_prose_and_drops_code():
    doc = (
        "Heading\n*******\n\n"
        "The first paragraph explains a thing. It has two\nsentences, e.g. this one.\n\n"
        "   >>> print('code')\n   code\n\n"
        "   if x:\n       return y\n\n"
        "   Indented prose is still prose when every line lines up with the others.\n\n"
        "short words.\n"
    )
    assert text.extract_paragraphs(doc) == [
        "The first paragraph explains a thing. It has two sentences, e.g. this one.",
        "Indented prose is still prose when every line lines up with the others.",
    ]
    assert text.extract_sentences(doc) == [
        "The first paragraph explains a thing.",
        "It has two sentences, e.g. this one.",
        "Indented prose is still prose when every line lines up with the others.",
    ]
    with pytest.raises(ValueError, match="min_words"):
        text.extract_sentences(doc, min_words=10, max_words=5)


def test_python_docs_give_enough_real_sentences():
    sentences = text.sentences()
    assert len(sentences) >= 500 and len(set(sentences)) == len(sentences)
    words = [w for s in sentences for w in s.split()]
    assert len(words) >= 10_000
    for s in sentences:
        assert s[0].isupper() or s[0] in "\"(", s
        assert s.endswith((".", "?", "!")) and 6 <= len(s.split()) <= 64, s
        assert not any(marker in s for marker in (">>>", "::=", "****")), s
    # English: the commonest words of the corpus are English function words.
    counts = {}
    for w in words:
        counts[w.lower()] = counts.get(w.lower(), 0) + 1
    top = sorted(counts, key=counts.get, reverse=True)[:10]
    assert {"the", "a", "of", "is", "to"} <= set(top), top
    tokens = sum(len(p.split()) for p in text.paragraphs())
    assert tokens >= 20_000  # words; the BPE token count is higher still


# ----------------------------------------------------------------------------- MiniLM encoder


def _numpy_bert(t: dict[str, np.ndarray], ids: np.ndarray, mask: np.ndarray, heads: int = 12) -> np.ndarray:
    """float64 BERT + mean pooling + L2 normalisation, straight from the safetensors tensors."""
    w = {k: v.astype(np.float64) for k, v in t.items()}

    def ln(x, p):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-12) * w[f"{p}.weight"] + w[f"{p}.bias"]

    def dense(x, p):
        return x @ w[f"{p}.weight"].T + w[f"{p}.bias"]

    b, n = ids.shape
    x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:n]
    x = ln(x + w["embeddings.token_type_embeddings.weight"][0], "embeddings.LayerNorm")
    neg = np.where(mask[:, None, None, :] > 0, 0.0, -1e30)
    layers = len({k.split(".")[2] for k in w if k.startswith("encoder.layer.")})
    for i in range(layers):
        p = f"encoder.layer.{i}"
        split = lambda y: y.reshape(b, n, heads, -1).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = (split(dense(x, f"{p}.attention.self.{m}")) for m in ("query", "key", "value"))
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1]) + neg
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        ctx = (a @ v).transpose(0, 2, 1, 3).reshape(b, n, -1)
        x = ln(x + dense(ctx, f"{p}.attention.output.dense"), f"{p}.attention.output.LayerNorm")
        h = dense(x, f"{p}.intermediate.dense")
        h = 0.5 * h * (1 + erf(h / np.sqrt(2)))
        x = ln(x + dense(h, f"{p}.output.dense"), f"{p}.output.LayerNorm")
    m = mask[..., None].astype(np.float64)
    pooled = (x * m).sum(1) / m.sum(1)
    return pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def minilm():
    """The NNX model, the tokenizer, and the raw checkpoint tensors."""
    return bert.load_minilm(), bert.minilm_tokenizer(), load_file(bert.minilm_files()["weights"])


def test_minilm_loader_reads_the_package(minilm):
    model, _, raw = minilm
    c = bert.minilm_config()
    assert (c.num_layers, c.hidden_size, c.num_heads, c.intermediate_size) == (6, 384, 12, 1536)
    linears = [m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Linear)]
    assert len(linears) == 6 * 6  # q, k, v, attention output, FFN in, FFN out per layer
    np.testing.assert_array_equal(
        np.asarray(model.layers[3].intermediate.kernel[...]), raw["encoder.layer.3.intermediate.dense.weight"].T
    )


def test_minilm_matches_numpy_forward(minilm, rng):
    model, tokenizer, raw = minilm
    pool = text.sentences()
    chosen = [pool[i] for i in rng.choice(len(pool), 6, replace=False)] + ["Short one."]
    ids, mask = bert.tokenize(tokenizer, chosen)
    assert ids.shape[1] % 16 == 0 and mask.sum(1).min() < ids.shape[1]  # padding is exercised
    expected = _numpy_bert(raw, ids, mask)
    got = np.asarray(_embed(model, jnp.asarray(ids), jnp.asarray(mask)), np.float64)
    cosine = (got * expected).sum(-1)
    assert cosine.min() >= 0.9999, cosine
    # The embeddings carry meaning: a paraphrase is nearer than an unrelated sentence.
    related = ["The cat sits on the mat.", "A kitten is sitting on a rug.", "Interest rates rose sharply."]
    e = np.asarray(_embed(model, *map(jnp.asarray, bert.tokenize(tokenizer, related))))
    assert e[0] @ e[1] > e[0] @ e[2] + 0.3


def test_minilm_ffn_shift_is_folded_exactly(minilm, rng):
    """The shifted-GELU layout (non-negative FFN inputs) computes the same function as the plain one."""
    shifted, tokenizer, raw = minilm
    config = bert.minilm_config()
    assert config.ffn_input_shift > 0.16997  # above -min GELU: the FFN output layer's inputs are >= 0
    plain = bert.load_minilm(config=dataclasses.replace(config, ffn_input_shift=0.0))
    w, b = raw["encoder.layer.2.output.dense.weight"], raw["encoder.layer.2.output.dense.bias"]
    np.testing.assert_array_equal(np.asarray(plain.layers[2].output.bias[...]), b)
    np.testing.assert_allclose(
        np.asarray(shifted.layers[2].output.bias[...]), b - config.ffn_input_shift * w.sum(1), rtol=0, atol=1e-6
    )
    pool = text.sentences()
    chosen = [pool[i] for i in rng.choice(len(pool), 4, replace=False)]
    ids, mask = map(jnp.asarray, bert.tokenize(tokenizer, chosen))
    cosine = (np.asarray(_embed(shifted, ids, mask)) * np.asarray(_embed(plain, ids, mask))).sum(-1)
    assert cosine.min() >= 0.99999
    with pytest.raises(ValueError, match="config"):
        bert.load_minilm(config=dataclasses.replace(config, num_layers=2))


def test_minilm_tokenizer_round_trip(minilm):
    _, tokenizer, _ = minilm
    sentence = "Return a new view of the dictionary’s items, tokenized as WordPiece."
    ids, mask = bert.tokenize(tokenizer, [sentence])
    real = ids[0, : mask[0].sum()].tolist()
    assert real[0] == 101 and real[-1] == 102 and set(ids[0, mask[0].sum():].tolist()) <= {0}
    decoded = tokenizer.decode(real)
    assert decoded == "return a new view of the dictionary ’ s items, tokenized as wordpiece."  # lowercased
    assert bert.tokenize(tokenizer, [decoded])[0].tolist() == ids.tolist()
    with pytest.raises(ValueError, match="sentences"):
        bert.tokenize(tokenizer, "not a list")


# ----------------------------------------------------------------------------- SmolLM2 decoder


def _numpy_llama_logits(t: dict[str, np.ndarray], tokens: list[int], c: llama.LlamaConfig) -> np.ndarray:
    """float64 logits of the last position, GGUF row order, llama.cpp interleaved-pair RoPE."""
    w = t.__getitem__
    n, d, g = len(tokens), c.head_dim, c.num_heads // c.num_kv_heads
    rms = lambda x, s: x / np.sqrt((x**2).mean(-1, keepdims=True) + c.rms_norm_eps) * s  # noqa: E731
    angle = np.arange(n)[:, None] * c.rope_theta ** (-np.arange(0, d, 2) / d)
    rot = np.exp(1j * angle)[:, None, :]  # (n, 1, d/2)

    def rope(x):  # x: (n, heads, d); pairs (2i, 2i+1) are one complex number
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * rot
        return np.stack([z.real, z.imag], -1).reshape(x.shape)

    x = w("token_embd.weight")[tokens]
    causal = np.tril(np.ones((n, n), bool))
    for i in range(c.num_layers):
        p = f"blk.{i}"
        h = rms(x, w(f"{p}.attn_norm.weight"))
        q = rope((h @ w(f"{p}.attn_q.weight").T).reshape(n, c.num_heads, d))
        k = rope((h @ w(f"{p}.attn_k.weight").T).reshape(n, c.num_kv_heads, d))
        v = (h @ w(f"{p}.attn_v.weight").T).reshape(n, c.num_kv_heads, d)
        k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        s = np.where(causal, s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", a, v).reshape(n, -1) @ w(f"{p}.attn_output.weight").T
        h = rms(x, w(f"{p}.ffn_norm.weight"))
        gate = h @ w(f"{p}.ffn_gate.weight").T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w(f"{p}.ffn_up.weight").T)) @ w(f"{p}.ffn_down.weight").T
    return rms(x[-1], w("output_norm.weight")) @ w("token_embd.weight").T


@pytest.fixture(scope="module")
def smollm2():
    tensors64 = {name: w.astype(np.float64) for name, w in llama.gguf_tensors().items()}
    return llama.load_smollm2(), llama.smollm2_tokenizer(), tensors64


def test_smollm2_loader_reads_the_package(smollm2):
    model, _, tensors = smollm2
    c = model.config
    shape = (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads)
    assert shape == (576, 1536, 30, 9, 3)
    assert c.tie_embeddings and not hasattr(model, "lm_head")
    linears = [m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Linear)]
    assert len(linears) == 30 * 7
    down = np.asarray(model.layers[5].mlp.down_proj.kernel[...])
    np.testing.assert_array_equal(down, tensors["blk.5.ffn_down.weight"].T)
    # q/k rows are un-permuted: within each head, GGUF row 2i+h is Hugging Face row h·D/2 + i.
    gguf_k, ours = tensors["blk.2.attn_k.weight"], np.asarray(model.layers[2].attention.k_proj.kernel[...]).T
    d = c.head_dim
    np.testing.assert_array_equal(ours[d + 3], gguf_k[d + 6])
    np.testing.assert_array_equal(ours[d + d // 2 + 3], gguf_k[d + 7])


def test_smollm2_logits_match_numpy(smollm2, rng):
    model, tokenizer, tensors = smollm2
    sentence = text.sentences()[int(rng.integers(len(text.sentences())))]
    tokens = tokenizer.encode(sentence).ids[:12]
    logits, cache = nnx.jit(lambda m, t: m(t))(model, jnp.asarray([tokens]))
    assert cache is None and logits.shape == (1, len(tokens), model.config.vocab_size)
    got = np.asarray(logits[0, -1], np.float64)
    expected = _numpy_llama_logits(tensors, tokens, model.config)
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1e-4
    assert np.argmax(got) == np.argmax(expected)


def test_smollm2_greedy_generation_matches_numpy(smollm2):
    model, tokenizer, tensors = smollm2
    prompt = tokenizer.encode("The capital of France is").ids
    steps = 4
    got = np.asarray(llama.generate(model, jnp.asarray([prompt, prompt]), max_new_tokens=steps))
    assert got.shape == (2, steps) and (got[0] == got[1]).all()
    expected = list(prompt)
    for _ in range(steps):
        expected.append(int(np.argmax(_numpy_llama_logits(tensors, expected, model.config))))
    assert got[0].tolist() == expected[len(prompt):]
    assert "Paris" in tokenizer.decode(got[0].tolist())


def test_smollm2_tokenizer_round_trip(smollm2):
    _, tokenizer, _ = smollm2
    for s in (text.paragraphs()[7], "Ünïcödé — 3.14159 and naïve café!\n\tTabs  and  spaces."):
        assert tokenizer.decode(tokenizer.encode(s).ids) == s
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2  # control tokens are single ids (bos 1, eos 2)
    assert tokenizer.encode("12345").tokens == ["1", "2", "3", "4", "5"]  # digits are split
    words = tokenizer.encode(" the function returns the value of the expression").tokens
    assert len(words) == 8 and all(re.fullmatch("Ġ[a-z]+", w) for w in words)  # common words are one token
