"""The kernel layout of svdq int4 weights: what ``csrc/kernels/sm90/w4a4_gemm.cu`` reads, byte for byte.

The logical layout (``formats.svdq``) is uint8 ``(N, K/2)``: two signed int4 values per byte along K,
the even column in the low nibble. The sm90 W4A4 GEMM feeds the weights to ``wgmma ... k32 .e4m3`` as
the A operand **from registers**: every consumer thread loads its fragments with one 16-byte shared
memory load, converts the nibbles to e4m3 in registers and issues the wgmma. (Long prefills, from
``budget.w4a4_expanded_weights_min_tokens()`` tokens, first expand this layout to row-major e4m3 bytes in
the call's workspace, by the same fragment map, and load the fragments from shared memory unconverted.)
The weights are reordered offline ("prepacked") so that this load is exactly the thread's fragment:

* **Block**: 64 rows (n) x 64 columns (k) = one weight group of one consumer warpgroup = 2048 bytes.
  ``prepacked[nb, kb]`` is the block of rows ``[64 nb, 64 nb + 64)`` and columns ``[64 kb, 64 kb + 64)``;
  the array is ``(ceil(N/64), ceil(K/64), 2048)`` uint8, zero-padded, so a CTA's stage (2 x 2 blocks) is
  one 3-D TMA box.
* **Thread** ``tid`` (0..127 of the warpgroup: warp ``w = tid // 32``, lane ``L``, ``g = L // 4``,
  ``t = L % 4``) owns bytes ``[16 tid, 16 tid + 16)`` of a block: 4 little-endian words ``j = 0..3``.
* **Word** ``j``, byte ``p`` (0..3) is the logical byte at row ``16 w + g + 8 (p >> 1)`` and columns
  ``16 j + 4 t + 2 (p & 1) + {0, 1}`` of the block (low nibble = even column, as in the logical layout;
  the nibbles are not re-encoded, the bytes are only permuted).
* The kernel turns word ``j`` into two fragment registers, ``o = 2 j`` from its low 16 bits and
  ``o = 2 j + 1`` from its high 16 bits (4 nibbles -> 4 e4m3 bytes each: a ``prmt`` table lookup of
  ``q`` for prefill tiles, the offset code ``q + 8`` read as e4m3 ``(q + 8)·2^-9`` for decode tiles).
  Registers ``o = 4 s .. 4 s + 3`` are the A fragment of k-step ``s`` (k in ``[32 s, 32 s + 32)``),
  in the PTX ISA order of the wgmma ``.m64nNk32`` 8-bit A fragment: register ``r`` holds row
  ``16 w + g + 8 (r & 1)``, columns ``32 s + 16 (r >> 1) + 4 t + {0..3}``.

**Weight scales** (``prepack_scales``): the logical ``(N, K/64)`` group scales are stored stage-major,
``(K/128, N, 2)`` in their own dtype: ``prepacked_scales[ks, n, h] = wscales[n, 2 ks + h]``. A CTA's
K-stage (128 columns of K, two groups) over its 128 output columns is then 512 contiguous bytes, which
one bulk copy brings into shared memory as the ``[column][group 0, group 1]`` rows the consumers read.
(Read from the logical layout, the same 512 bytes were 128 scattered 4-byte copies per stage; they cost
the decode GEMM 6 us at 1 x 28672 x 8192, benchmarks/NOTES.md session 9.)

``unprepack`` / ``unprepack_scales`` are the bit-exact inverses of ``prepack`` / ``prepack_scales``
(padding dropped); all four are pure ``jnp`` and jit-able.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

PREPACKED_DTYPE = jnp.uint8

BLOCK_N = 64  # rows of a block: the 64 output columns of one consumer warpgroup
BLOCK_K = 64  # columns of a block: one weight group (two wgmma k32 steps)
BLOCK_BYTES = BLOCK_N * BLOCK_K // 2  # 128 threads x 16 bytes
KERNEL_N_MULTIPLE = 128  # the kernel's tile of output columns
KERNEL_K_MULTIPLE = 128  # the kernel's K per pipeline stage
GROUPS_PER_STAGE = KERNEL_K_MULTIPLE // BLOCK_K  # weight groups per stage: the last axis of the prepacked scales

# The logical bytes (padded) viewed as (nb, w, ph, g, kb, j, t, pl): row = 64 nb + 16 w + 8 ph + g, byte
# column = 32 kb + 8 j + 2 t + pl. The prepacked array is (nb, kb) blocks x (w, g, t) threads x (j, ph, pl)
# bytes (p = 2 ph + pl).
_LOGICAL_VIEW = (4, 2, 8, 4, 4, 2)  # (w, ph, g) rows, (j, t, pl) bytes of a block
_TO_PREPACKED = (0, 4, 1, 3, 6, 5, 2, 7)  # (nb, w, ph, g, kb, j, t, pl) -> (nb, kb, w, g, t, j, ph, pl)


def _blocks(size: int, block: int) -> int:
    return -(-size // block)


def prepacked_shape(n: int, k: int) -> tuple[int, int, int]:
    """Shape of the prepacked uint8 array of an ``(N, K)`` int4 weight: ``(ceil(N/64), ceil(K/64), 2048)``."""
    return (_blocks(n, BLOCK_N), _blocks(k, BLOCK_K), BLOCK_BYTES)


def check_shape(n: int, k: int) -> None:
    """Raises ValueError when the sm90 W4A4 kernel cannot serve an ``(N, K)`` weight."""
    if n <= 0 or n % KERNEL_N_MULTIPLE:
        raise ValueError(
            f"w4a4 kernel: N (qweight rows) must be a positive multiple of {KERNEL_N_MULTIPLE}, got {n}"
        )
    if k <= 0 or k % KERNEL_K_MULTIPLE:
        raise ValueError(
            f"w4a4 kernel: K (2 * qweight.shape[1]) must be a positive multiple of {KERNEL_K_MULTIPLE}, got {k}"
        )


def prepack(qweight: ArrayLike) -> jax.Array:
    """Logical uint8 ``(N, K/2)`` signed int4 weights -> the kernel layout (module docstring)."""
    qweight = jnp.asarray(qweight)
    if qweight.ndim != 2 or qweight.dtype != jnp.uint8:
        raise ValueError(f"qweight must be uint8 (N, K/2), got {qweight.dtype}{tuple(qweight.shape)}")
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    nb, kb, _ = prepacked_shape(n, k)
    padded = jnp.pad(qweight, ((0, nb * BLOCK_N - n), (0, kb * BLOCK_K // 2 - k // 2)))
    rows, cols = _LOGICAL_VIEW[:3], _LOGICAL_VIEW[3:]
    blocks = padded.reshape(nb, *rows, kb, *cols).transpose(_TO_PREPACKED)
    return blocks.reshape(nb, kb, BLOCK_BYTES)


def prepacked_scales_shape(n: int, k: int) -> tuple[int, int, int]:
    """Shape of the prepacked ``(N, K/64)`` weight scales: ``(K/128, N, 2)`` (K a multiple of 128)."""
    return (k // KERNEL_K_MULTIPLE, n, GROUPS_PER_STAGE)


def prepacked_scales_sizes(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(N, K)`` of prepacked weight scales of ``shape`` ``(K/128, N, 2)``: the inverse of
    :func:`prepacked_scales_shape`."""
    stages, n, _ = shape
    return n, stages * KERNEL_K_MULTIPLE


def prepack_scales(wscales: ArrayLike) -> jax.Array:
    """Logical ``(N, K/64)`` weight scales -> the stage-major kernel layout ``(K/128, N, 2)`` (module docstring)."""
    wscales = jnp.asarray(wscales)
    if wscales.ndim != 2 or wscales.shape[1] % GROUPS_PER_STAGE:
        raise ValueError(
            f"wscales must be (N, K/64) with K a multiple of {KERNEL_K_MULTIPLE} (an even number of groups), "
            f"got {tuple(wscales.shape)}"
        )
    n, groups = wscales.shape
    return wscales.reshape(n, groups // GROUPS_PER_STAGE, GROUPS_PER_STAGE).transpose(1, 0, 2)


def unprepack_scales(prepacked_scales: ArrayLike) -> jax.Array:
    """The stage-major ``(K/128, N, 2)`` layout -> logical ``(N, K/64)``, the inverse of :func:`prepack_scales`."""
    prepacked_scales = jnp.asarray(prepacked_scales)
    if prepacked_scales.ndim != 3 or prepacked_scales.shape[2] != GROUPS_PER_STAGE:
        raise ValueError(f"prepacked scales must be (K/128, N, 2), got {tuple(prepacked_scales.shape)}")
    stages, n, _ = prepacked_scales.shape
    return prepacked_scales.transpose(1, 0, 2).reshape(n, stages * GROUPS_PER_STAGE)


def unprepack(prepacked: ArrayLike, n: int, k: int) -> jax.Array:
    """The kernel layout -> logical uint8 ``(N, K/2)``, the bit-exact inverse of :func:`prepack`."""
    prepacked = jnp.asarray(prepacked)
    if k % 2:
        raise ValueError(f"k must be even (two int4 values per byte), got {k}")
    if tuple(prepacked.shape) != prepacked_shape(n, k) or prepacked.dtype != PREPACKED_DTYPE:
        raise ValueError(
            f"prepacked must be uint8 {prepacked_shape(n, k)} for (N, K) = ({n}, {k}), "
            f"got {prepacked.dtype}{tuple(prepacked.shape)}"
        )
    # A gather with indices from iotas (XLA:CPU compiles the inverse 8-D transpose very slowly).
    row = jnp.arange(n, dtype=jnp.int32)[:, None]
    col = jnp.arange(k // 2, dtype=jnp.int32)[None, :]
    w, ph, g = (row % BLOCK_N) // 16, (row % 16) // 8, row % 8
    j, t, pl = (col % 32) // 8, (col % 8) // 2, col % 2
    byte = 16 * (32 * w + 4 * g + t) + 4 * j + 2 * ph + pl
    return prepacked[row // BLOCK_N, col // 32, byte]
