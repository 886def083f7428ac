"""The kernel layout of w4a16 weights: what ``csrc/kernels/sm90/w4a16_gemm.cu`` reads, byte for byte.

The logical layout (``formats.w4a16``) is uint8 ``(N, K/2)``: two uint4 values per byte along K. The
kernel wants every 16-byte load of a lane to be exactly its A fragments (the mma.sync m16n8k16 layout,
which is also a warp's 16-row slice of the register A operand of wgmma m64nNk16), so the weights are
reordered offline ("prepacked") into int32 words:

* **Atom**: 16 rows (n) x 64 columns (k) = 512 bytes = 32 lanes x 4 words. Row block ``nb`` of the
  prepacked array holds the atoms of rows ``[16 nb, 16 nb + 16)`` in k order, so a row block is
  ``K/64`` atoms = ``2 K`` words, and atom ``a`` of row block ``nb`` is words ``[128 a, 128 a + 128)``.
* **Word** ``j`` (0..3) of lane ``L`` in an atom is lane L's A fragment of the ``j``-th m16n8k16 step
  (k in ``[16 j, 16 j + 16)``), with ``g = L // 4`` and ``t = L % 4``. Its nibble ``p`` (bits
  ``4p .. 4p+3``) holds q at row ``g + 8 (p & 1)`` and column ``16 j + 2 t + 8 ((p >> 1) & 1) + (p >> 2)``.
  So nibbles ``(p, p + 4)`` are the two halves of fragment register ``p`` (the kernel turns each pair
  into a half2 with one ``lop3`` and one ``fma``: the 0x6400 fp16 / 0x4300 bf16 exponent trick).
* **Act-order**: with a ``g_idx``, the K axis is stored in the stable order of ``argsort(g_idx)``
  (MARLIN's permutation), so every group is a contiguous run of ``group_size`` columns and the kernel
  sees plain groups. The run-time activations are gathered with the same permutation by the kernel.
  This needs GPTQ act-order ``g_idx`` (each group holds exactly ``group_size`` columns); ``prepack``
  checks that when ``g_idx`` is concrete, and the kernel outputs NaN (never a wrong number) when the
  ``g_idx`` it is given does not match the prepacked permutation.
* **Scales and zero points** (:func:`prepack_scales`): the logical ``(N, K/G)`` arrays transposed to
  ``(K/G, N)``, so the scales of one group for a CTA's rows are one contiguous run that the kernel loads
  with one TMA box per K atom (its raw loads of the ``(N, K/G)`` layout cost ~9% at decode). This is
  also the layout of AutoGPTQ / AutoAWQ checkpoints.
* **Tail row** (the last row of the array): words ``[0, K')`` are the permutation ``perm`` (stored
  column ``i`` is logical column ``perm[i]``; identity without act-order), word ``K'`` is 1 when the
  permutation is not the identity, the rest is 0.

Shapes that are not multiples of the atom are zero-padded (``K' = 64 ceil(K / 64)`` columns,
``16 ceil(N / 16)`` rows), so every logical array has a prepacked form and ``unprepack`` is its
bit-exact inverse; the CUDA kernel itself serves the shapes that :func:`check_shape` accepts.
Everything here is jit-able (``prepack`` validates ``g_idx`` only when it is concrete).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

PREPACKED_DTYPE = jnp.int32

ATOM_N = 16  # rows of an atom (one m16 MMA tile of W)
ATOM_K = 64  # columns of an atom (four k16 MMA steps)
WORDS_PER_ATOM = ATOM_N * ATOM_K // 8  # 128 int32 words of 8 nibbles
KERNEL_N_MULTIPLE = 32  # rows per warp in the kernel
KERNEL_GROUP_SIZES = (32, 64, 128)  # plus K itself (per channel)


def _blocks(n: int) -> int:
    return -(-n // ATOM_N)


def _padded_k(k: int) -> int:
    return -(-k // ATOM_K) * ATOM_K


def prepacked_shape(n: int, k: int) -> tuple[int, int]:
    """Shape of the prepacked int32 array of an ``(N, K)`` uint4 weight: ``(ceil(N/16) + 1, 2 K')``."""
    return (_blocks(n) + 1, 2 * _padded_k(k))


def check_shape(n: int, k: int, group_size: int) -> None:
    """Raises ValueError when the CUDA kernel cannot serve ``(N, K)`` with this group size."""
    if n % KERNEL_N_MULTIPLE:
        raise ValueError(
            f"w4a16 kernel: N (scales.shape[1]) must be a multiple of {KERNEL_N_MULTIPLE}, got {n}"
        )
    if k % ATOM_K:
        raise ValueError(f"w4a16 kernel: K (x.shape[-1]) must be a multiple of {ATOM_K}, got {k}")
    if group_size not in (*KERNEL_GROUP_SIZES, k, -1):
        raise ValueError(
            f"w4a16 kernel: group_size must be one of {KERNEL_GROUP_SIZES} or K={k} (per channel), "
            f"got {group_size}"
        )
    if group_size > 0 and k % group_size:
        raise ValueError(f"w4a16 kernel: K={k} must be a multiple of group_size={group_size}")


def _unpack_nibbles(qweight: jax.Array) -> jax.Array:
    """uint8 (N, K/2) -> uint8 (N, K) values 0..15 (element 2i in the low nibble)."""
    low = qweight & 0xF
    high = qweight >> 4
    return jnp.stack([low, high], axis=-1).reshape(qweight.shape[0], -1)


def _pack_nibbles(q: jax.Array) -> jax.Array:
    pairs = q.reshape(q.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)


def _bytes_to_words(packed_bytes: jax.Array) -> jax.Array:
    """uint8 (..., 4) -> int32 (...): byte b is bits 8b..8b+7 (little-endian, explicitly)."""
    b = packed_bytes.astype(jnp.uint32)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return jax.lax.bitcast_convert_type(words, jnp.int32)


def _words_to_bytes(words: jax.Array) -> jax.Array:
    """int32 (...) -> uint8 (..., 4), the inverse of :func:`_bytes_to_words`."""
    w = jax.lax.bitcast_convert_type(words, jnp.uint32)
    return jnp.stack([(w >> (8 * b)) & 0xFF for b in range(4)], axis=-1).astype(jnp.uint8)


def act_order_permutation(g_idx: ArrayLike, k: int, group_size: int) -> jax.Array:
    """The stored K order for act-order: ``perm = argsort(g_idx)`` (stable), int32 ``(K,)``.

    Checks (when ``g_idx`` is concrete) that every group holds exactly ``group_size`` columns, the
    GPTQ act-order structure the kernel relies on.
    """
    g_idx = jnp.asarray(g_idx)
    if g_idx.shape != (k,):
        raise ValueError(f"g_idx must have shape ({k},), got {tuple(g_idx.shape)}")
    group_size = k if group_size == -1 else group_size
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size must divide K={k} (or be -1 for per channel), got {group_size}")
    if not isinstance(g_idx, jax.core.Tracer):
        counts = np.bincount(np.asarray(g_idx).astype(np.int64).clip(-1, k) + 1, minlength=k + 2)
        groups = k // group_size
        if counts[0] or counts[groups + 1 :].any() or (counts[1 : groups + 1] != group_size).any():
            raise ValueError(
                f"g_idx: the w4a16 kernel layout needs GPTQ act-order indices (values in [0, {groups}), "
                f"each group holding exactly group_size={group_size} columns)"
            )
    return jnp.argsort(g_idx.astype(jnp.int32), stable=True).astype(jnp.int32)


def prepack(
    qweight: ArrayLike, *, g_idx: ArrayLike | None = None, group_size: int | None = None
) -> jax.Array:
    """Logical uint8 ``(N, K/2)`` -> the kernel's int32 layout (module docstring).

    With act-order, pass the ``g_idx`` the scales were built with and its ``group_size`` (-1 or K
    for per channel); the same ``g_idx`` must then be given to ``ops.w4a16_gemm``.
    """
    qweight = jnp.asarray(qweight)
    if qweight.ndim != 2 or qweight.dtype != jnp.uint8:
        raise ValueError(f"qweight must be uint8 (N, K/2), got {qweight.dtype}{tuple(qweight.shape)}")
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    nb, kp = _blocks(n), _padded_k(k)
    if g_idx is None:
        perm = jnp.arange(k, dtype=jnp.int32)
    else:
        if group_size is None:
            raise ValueError("prepack: group_size is needed together with g_idx")
        perm = act_order_permutation(g_idx, k, group_size)
    q = _unpack_nibbles(qweight)[:, perm]
    q = jnp.pad(q, ((0, nb * ATOM_N - n), (0, kp - k)))
    # (nb, r8, g, a, j, h, t, e): row = 16 nb + 8 r8 + g, column = 64 a + 16 j + 8 h + 2 t + e.
    q = q.reshape(nb, 2, 8, kp // ATOM_K, 4, 2, 4, 2)
    # -> (nb, a, lane = (g, t), word j, nibble p = (e, h, r8)), nibble p = r8 + 2 h + 4 e.
    q = q.transpose(0, 3, 2, 6, 4, 7, 5, 1).reshape(nb, kp // ATOM_K, 32, 4, 4, 2)
    packed_bytes = q[..., 0] | (q[..., 1] << 4)  # byte b holds nibbles 2b (low) and 2b + 1
    words = _bytes_to_words(packed_bytes).reshape(nb, 2 * kp)
    full_perm = jnp.concatenate([perm, jnp.arange(k, kp, dtype=jnp.int32)])
    permuted = jnp.any(perm != jnp.arange(k, dtype=jnp.int32)).astype(jnp.int32)
    tail = jnp.concatenate([full_perm, permuted[None], jnp.zeros(kp - 1, jnp.int32)])
    return jnp.concatenate([words, tail[None]], axis=0)


def prepack_scales(scales: ArrayLike) -> jax.Array:
    """Logical ``(N, K/G)`` scales (or uint8 zero points) -> the kernel layout ``(K/G, N)``."""
    scales = jnp.asarray(scales)
    if scales.ndim != 2:
        raise ValueError(f"scales / zeros must be 2-D (N, K/G), got shape {tuple(scales.shape)}")
    return scales.T


def unprepack_scales(prepacked: ArrayLike) -> jax.Array:
    """The kernel layout ``(K/G, N)`` -> logical ``(N, K/G)``, the inverse of :func:`prepack_scales`."""
    prepacked = jnp.asarray(prepacked)
    if prepacked.ndim != 2:
        raise ValueError(f"prepacked scales / zeros must be 2-D (K/G, N), got shape {tuple(prepacked.shape)}")
    return prepacked.T


def permutation(prepacked: ArrayLike, k: int) -> jax.Array:
    """The stored K order of a prepacked array (int32 ``(K,)``; the identity without act-order)."""
    return jnp.asarray(prepacked)[-1, :k]


def unprepack(prepacked: ArrayLike, n: int, k: int) -> jax.Array:
    """The kernel layout -> logical uint8 ``(N, K/2)``, bit-exact inverse of :func:`prepack`."""
    prepacked = jnp.asarray(prepacked)
    if tuple(prepacked.shape) != prepacked_shape(n, k) or prepacked.dtype != PREPACKED_DTYPE:
        raise ValueError(
            f"prepacked must be int32 {prepacked_shape(n, k)} for (N, K) = ({n}, {k}), "
            f"got {prepacked.dtype}{tuple(prepacked.shape)}"
        )
    nb, kp = _blocks(n), _padded_k(k)
    packed_bytes = _words_to_bytes(prepacked[:-1]).reshape(nb, kp // ATOM_K, 32, 4, 4)
    q = jnp.stack([packed_bytes & 0xF, packed_bytes >> 4], axis=-1)  # (nb, a, lane, j, nibble p)
    q = q.reshape(nb, kp // ATOM_K, 8, 4, 4, 2, 2, 2)  # (nb, a, g, t, j, e, h, r8)
    q = q.transpose(0, 7, 2, 1, 4, 6, 3, 5).reshape(nb * ATOM_N, kp)[:n, :k]
    perm = permutation(prepacked, k)
    inverse = jnp.zeros(k, jnp.int32).at[perm].set(jnp.arange(k, dtype=jnp.int32), unique_indices=True)
    return _pack_nibbles(q[:, inverse])
