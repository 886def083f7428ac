"""Automatic partitioning of the fused ops: a Shardy sharding rule and a ``custom_partitioning`` each.

Under plain ``jax.jit`` with weights placed by hand (``jax.device_put(w, NamedSharding(mesh, spec))``)
XLA knows nothing about our ops: the CUDA kernels are opaque custom calls and the CPU reference is a
long chain of unpacking ops, so without help the partitioner gathers the weights. Every primitive
therefore carries

* a **Shardy sharding rule** (an :class:`SdyShardingRule` built from the operand shapes): the factors
  that tie the operands together, e.g. for ``w4a4_gemm`` the N factor ``(nb bn)`` shared by the
  prepacked ``qweight`` (its ``N/64`` block axis), ``wscales``, ``lora_up``, α, β and the output, and
  the K factor ``ks`` (one 128-column stage; a reduction factor) shared by ``q_x``, ``s_x``,
  ``qweight``'s K-block axis and the stage axis of the prepacked ``wscales``. Factors that must never
  be split (inside a 64-row block, inside a stage, the rank r, the 2048 bytes of a block, the w4a16
  permutation row) are need-replication factors. Shardy (the default partitioner) propagates shardings through
  the op with it, so a column layer's N-sharded output reaches the next row layer as K-sharded x.
* a **partition callback** that decides the per-device computation from the shardings it is given:
  the *weights'* placement decides (they stay where they are; activations are resharded to match):

  - N sharded (column parallel): the local op on the local columns, output sharded on N. No
    communication. The whole W4A4 layer (``w4a4_linear``) is one partitioned op, so each shard runs
    the one FFI call that overlaps the GEMM with act_quant.
  - K sharded (row parallel): every shard runs the op on its K slice (activation groups never
    straddle a shard, so codes and scales are the unsharded ones) without β, then one fp32 ``psum``
    of the partial results and β once. ``w4a4_linear``: the whole layer, α times the partial main
    product (α distributes over the sum) plus the shard's share of the low-rank branch,
    ``(X_s · L_down,s) · L_up`` (:func:`w4a4_linear_row_shard`: the one call per shard, one all-reduce of
    the output only). ``act_quant`` alone psums its tiny ``(..., r)`` fp32 ``LA``; ``w4a4_gemm`` alone
    then computes its partial main product (rank 0), an fp32 ``psum``, ``LA · L_up`` and β once
    (:func:`w4a4_row_shard`); XLA's all-reduce combiner emits the two psums as one all-reduce. The
    tests assert the compiled count, ``jax_w4a4.sharding.ROW_PARALLEL_ALL_REDUCES`` = 1, as for the
    explicit path, whose per-shard code this is (:func:`w4a4_linear_row_shard`,
    :func:`w4a16_row_shard`); numerics: :mod:`jax_w4a4.sharding`.
  - token dims sharded (data parallel, even or not): passed through; nothing is communicated.

Unsupported placements fail when the program is compiled (``.lower(...).compile()`` or the first
call; JAX reports a ``JaxRuntimeError`` carrying the callback's ValueError, which names the dimension
and the multiple it needs; shardings are only known then): weights sharded across a
64-row block or an activation / weight group, the w4a16 permutation row or a byte axis sharded,
act-order (``g_idx``) or per-channel w4a16 sharded on K. Activations whose K sharding splits groups
are replicated instead (an all-gather of activations, never of weights).

**Why custom_partitioning on the op level.** It is the mechanism JAX offers to partition an opaque op
with a user rule, it runs under Shardy (the default partitioner; GSPMD callbacks are deprecated), and
per primitive it composes with any model code, as Transformer Engine's JAX primitives do. A
``shard_map`` can only be the answer when the caller knows the placement (that is the explicit path,
:mod:`jax_w4a4.sharding`). The whole layer is one op (``w4a4_linear``), so its row shards psum once by
construction; only ``act_quant`` and ``w4a4_gemm`` called apart psum twice (combined by XLA, see above).

**Why at the lowering, not around** :func:`jax_w4a4.linear`: the primitives stay primitives in
jaxprs (vmap, export and the shard_map path see exactly what they saw before) and only a lowering for
more than one device (a ``ShardingContext`` of several devices, i.e. ``jax.jit`` over a mesh) goes
through ``custom_partitioning``; a single device, ``shard_map`` bodies (``SPMDAxisContext``) and
the per-device modules that the partition callbacks build all take the local lowering (CUDA kernel
or reference). ``custom_partitioning`` has no batching rule, so wrapping ``linear`` itself would have
broken ``jax.vmap(linear)``. The primitives are registered as requiring devices at lowering (as
``custom_partitioning`` itself is): lowering with only an ``AbstractMesh`` is refused by JAX.

**w4a16 by hand.** The prepacked ``(N/16 + 1, 2K)`` array ends with the act-order permutation row,
so no even sharding of its rows follows N: place ``qweight`` with its rows replicated (``P()`` for
column, ``P(None, axis)`` for row) and ``scales`` / ``zeros`` / ``bias`` on N or K. Each device then
reads its row blocks (column) and rebuilds its identity permutation row (row) — a per-call copy of its
share of ``qweight``; :func:`jax_w4a4.shard_weights` re-lays the array out once instead.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import sharding_impls
from jax.experimental.custom_partitioning import (
    BATCHING,
    ArrayMapping,
    CompoundFactor,
    SdyShardingRule,
    custom_partitioning,
)
from jax.interpreters import mlir
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_w4a4 import reference
from jax_w4a4.formats import fp8, svdq, svdq_layout, w4a16_layout

Shape = tuple[int, ...]
Dim = tuple[str, ...]  # the factors of one dimension, major to minor (one: a plain factor)
Axes = tuple[str, ...]  # the mesh axes that shard one dimension, major to minor


def _fail(op: str, message: str) -> None:
    raise ValueError(f"jax_w4a4.{op} (automatic partitioning): {message}")


def act_group(act_format: str) -> int:
    """The activation group along K: 128 for fp8, 64 for int4 / uint4."""
    return fp8.GROUP_SIZE if act_format == "fp8" else svdq.GROUP_SIZE


# --------------------------------------------------------------------------------------------------
# Sharding rules


def _rule(
    operands: Sequence[Sequence[Dim]],
    results: Sequence[Sequence[Dim]],
    sizes: dict[str, int],
    *,
    batched: Sequence[bool],
    reduction: Sequence[str] = (),
    replicated: Sequence[str] = (),
) -> SdyShardingRule:
    """An SdyShardingRule from per-value dims (tuples of factors; ``batched`` values get a leading
    ``...``). Size-1 factors are dropped from compound dims; ``sizes`` holds every factor's size and
    is passed for the factors that never form a whole dimension."""
    whole: set[str] = set()

    def mapping(dims: Sequence[Dim], lead: bool) -> ArrayMapping:
        out = [BATCHING] if lead else []
        for dim in dims:
            kept = tuple(f for f in dim if sizes.get(f) != 1) or dim[:1]
            if len(kept) == 1:
                whole.add(kept[0])
                out.append(kept[0])
            else:
                out.append(CompoundFactor(*kept))
        return ArrayMapping(*out)

    values = [mapping(d, b) for d, b in zip([*operands, *results], batched)]
    # Factors in order of first use (Shardy wants the special factors listed in that order).
    used = list(dict.fromkeys(f for m in values for d in m for f in ((d,) if isinstance(d, str) else d)
                              if f != BATCHING))
    return SdyShardingRule(
        tuple(values[: len(operands)]),
        tuple(values[len(operands) :]),
        reduction_factors=tuple(f for f in used if f in reduction),
        need_replication_factors=tuple(f for f in used if f in replicated),
        **{f: s for f, s in sizes.items() if f in used and f not in whole},
    )


def _act_quant_rule(shapes: Sequence[Shape], act_format: str) -> SdyShardingRule:
    x, _, lora_down = shapes[:3]
    group = act_group(act_format)
    k = ("ku", "g")
    sizes = dict(ku=x[-1] // group, g=group, r=lora_down[1])
    return _rule(
        [[k], [k], [k, ("r",)]], [[k], [("ku",)], [("r",)]], sizes,
        batched=[True, False, False, True, True, True], replicated=("g", "r"),
    )


def _w4a4_weight_factors(rank: int, weights: Sequence[Shape]) -> tuple[list[list[Dim]], Dim, dict[str, int]]:
    """The dims of a W4A4 layer's weights (qweight, wscales, lora_up, alpha, bias), its N factor(s) and the
    factor sizes. K = (ks h kk): 128-column stages (ks, a reduction factor) of two 64-column blocks."""
    qweight, wscales, _, alpha, bias = weights
    stages, n, halves = wscales  # prepacked scales (K/128, N, 2): K = (ks h kk), a 128-column stage = (h kk)
    sizes = dict(ks=stages, h=halves, kk=svdq.GROUP_SIZE, r=rank, c=svdq_layout.BLOCK_BYTES, a0=0, b0=0)
    if n == qweight[0] * svdq_layout.BLOCK_N:  # whole 64-row blocks: N = (nb bn)
        nf, qn = ("nb", "bn"), ("nb",)
        sizes.update(nb=qweight[0], bn=svdq_layout.BLOCK_N)
    else:  # padded blocks: N cannot be split with qweight
        nf, qn = ("n",), ("nq",)
        sizes.update(n=n, nq=qweight[0])
    dims = [
        [qn, ("ks", "h"), ("c",)], [("ks",), nf, ("h",)], [("r",), nf],
        [nf if alpha[0] else ("a0",)], [nf if bias[0] else ("b0",)],
    ]
    return dims, nf, sizes


_W4A4_REPLICATED = ("h", "kk", "r", "c", "bn", "nq", "a0", "b0")  # inside a stage, block or rank; empty vectors


def _w4a4_gemm_rule(shapes: Sequence[Shape], act_format: str) -> SdyShardingRule:
    la = shapes[2]
    weights, nf, sizes = _w4a4_weight_factors(la[-1], shapes[3:8])
    # Activation scales: one per 64-column block (int4), one per stage (fp8).
    x_scales = ("ks",) if act_group(act_format) == svdq_layout.KERNEL_K_MULTIPLE else ("ks", "h")
    return _rule(
        [[("ks", "h", "kk")], [x_scales], [("r",)], *weights], [[nf]], sizes,
        batched=[True, True, True, False, False, False, False, False, True],
        reduction=("ks",), replicated=_W4A4_REPLICATED,
    )


def _w4a4_linear_rule(shapes: Sequence[Shape], act_format: str) -> SdyShardingRule:
    del act_format  # K splits in whole stages, which hold whole groups of either format
    lora_down = shapes[2]
    weights, nf, sizes = _w4a4_weight_factors(lora_down[1], shapes[3:8])
    k = ("ks", "h", "kk")
    return _rule(
        [[k], [k], [k, ("r",)], *weights], [[nf]], sizes,
        batched=[True, False, False, False, False, False, False, False, True],
        reduction=("ks",), replicated=_W4A4_REPLICATED,
    )


def _w4a16_gemm_rule(shapes: Sequence[Shape], group_size: int) -> SdyShardingRule:
    x, qweight, scales, zeros, g_idx, bias = shapes[:6]
    k, n = x[-1], scales[1]  # scales in the kernel layout (K/G, N)
    unit = max(w4a16_layout.ATOM_K, group_size)  # whole atoms and whole groups
    sizes = dict(n=n, qr=qweight[0], z0=0, g0=0, b0=0)
    if group_size != k and k % unit == 0:  # K = (ku kx): shardable in units
        sizes.update(ku=k // unit, kx=unit, kw=2 * unit, kg=unit // group_size)
        kx, kw, kg = ("ku", "kx"), ("ku", "kw"), ("ku", "kg")
    else:
        sizes.update(kx=k, kw=qweight[1], kg=scales[0])
        kx, kw, kg = ("kx",), ("kw",), ("kg",)
    return _rule(
        [
            [kx], [("qr",), kw], [kg, ("n",)], [kg, ("n",)] if zeros[0] else [("z0",)],
            [kx if g_idx[0] else ("g0",)], [("n",) if bias[0] else ("b0",)],
        ],
        [[("n",)]],
        sizes,
        batched=[True, False, False, False, False, False, True],
        reduction=("ku",), replicated=("kx", "kw", "kg", "qr", "z0", "g0", "b0"),
    )


# --------------------------------------------------------------------------------------------------
# Partition callbacks


def _dim_axes(value: jax.ShapeDtypeStruct) -> list[Axes]:
    """The mesh axes sharding each dimension of ``value`` (``()`` for a replicated dimension)."""
    spec = tuple(value.sharding.spec) + (None,) * value.ndim
    return [() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in spec[: value.ndim]]


def _size(mesh: Mesh, axes: Axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _entry(axes: Axes) -> str | tuple[str, ...] | None:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _lead(value: jax.ShapeDtypeStruct, taken: Axes) -> list[str | tuple[str, ...] | None]:
    """The token dims' spec entries of an activation, without the axes the weights use."""
    return [_entry(tuple(a for a in axes if a not in taken)) for axes in _dim_axes(value)[:-1]]


def _named(mesh: Mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def _decode(op: str, mesh: Mesh, values: Sequence[jax.ShapeDtypeStruct]) -> list[jax.ShapeDtypeStruct]:
    """The operands with NamedShardings of ``mesh`` (the callbacks get XLA's HLO shardings).

    Shardy expresses a mesh axis that a factor cannot hold whole (a shard boundary inside a block or
    group) as sub-axes, which no PartitionSpec of ``mesh`` can name: such a weight is a ValueError,
    such an activation is treated as replicated (the partition callback then picks its sharding).
    """
    if mesh.empty:
        _fail(op, "the operands must be placed with NamedShardings of one mesh (jax.device_put(w, NamedSharding(...)))")
    names, activations = OPERANDS[op]
    decoded = []
    for name, value in zip(names, values):
        try:
            spec = sharding_impls.parse_flatten_op_sharding(value.sharding._to_xla_hlo_sharding(value.ndim), mesh)[0]
        except ValueError as error:
            if name not in activations:
                _fail(op, f"{name} {tuple(value.shape)} is sharded with shard boundaries that split a mesh axis "
                          f"({error}): shard N / K in whole 64-row blocks and whole activation / weight groups")
            spec = P()
        decoded.append(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(mesh, spec)))
    return decoded


def _act_quant_partition(bind, params, mesh, arg_shapes):
    x, smooth, lora_down = arg_shapes
    k, group = x.shape[-1], act_group(params["act_format"])
    x_dims = _dim_axes(x)
    # The weights decide (lora_down, else smooth); unplaced weights follow x.
    k_axes = (lora_down.shape[1] and _dim_axes(lora_down)[0]) or _dim_axes(smooth)[0]
    shards = _size(mesh, k_axes)
    if k_axes and (k // group) % shards:
        _fail("act_quant", f"K must be a multiple of {group * shards} ({group}-wide {params['act_format']} "
                           f"activation groups x {shards} shards of {k_axes}) to shard smooth / lora_down, got {k}")
    if not k_axes:
        k_axes = x_dims[-1]
        if {a for axes in x_dims[:-1] for a in axes} & set(k_axes) or (k // group) % _size(mesh, k_axes):
            k_axes = ()  # groups would straddle shards: replicate K (an all-gather of activations only)
    lead, kk = _lead(x, k_axes), _entry(k_axes)

    def local(x, smooth, lora_down):
        q, s, la = bind(x, smooth, lora_down, **params)
        return q, s, lax.psum(la, k_axes) if k_axes else la

    results = [P(*lead, kk), P(*lead, kk), P(*lead, None)]
    return mesh, local, _named(mesh, results), _named(mesh, (P(*lead, kk), P(kk), P(kk, None)))


def _w4a4_weight_axes(op: str, mesh: Mesh, qweight, wscales) -> tuple[Axes, Axes]:
    """The mesh axes that shard a W4A4 layer's N and K, from its prepacked weights' placement (checked)."""
    n_axes, k_axes, byte_axes = _dim_axes(qweight)
    if byte_axes:
        _fail(op, f"qweight's last axis (the bytes of a 64 x 64 block) must not be sharded, got {qweight.sharding.spec}")
    n, k = svdq_layout.prepacked_scales_sizes(wscales.shape)
    stage, shards_k, shards_n = svdq_layout.KERNEL_K_MULTIPLE, _size(mesh, k_axes), _size(mesh, n_axes)
    if k % (stage * shards_k):
        _fail(op, f"K (in_features) must be a multiple of {stage * shards_k} ({stage}-column stages of the prepacked "
                  f"weight scales x {shards_k} shards of {k_axes}) to shard qweight's K blocks, got {k}")
    if n % (svdq_layout.BLOCK_N * shards_n):
        _fail(op, f"N (out_features) must be a multiple of {svdq_layout.BLOCK_N * shards_n} (64-row blocks x "
                  f"{shards_n} shards of {n_axes}) to shard qweight's N blocks, got {n}")
    return n_axes, k_axes


def _w4a4_weight_specs(nn, kk, alpha, bias) -> tuple[P, ...]:
    """The shardings of qweight, wscales, lora_up, alpha and bias for N on ``nn`` and K on ``kk``."""

    def vector(v):
        return P(nn) if v.shape[0] else P(None)

    return P(nn, kk, None), P(kk, nn, None), P(None, nn), vector(alpha), vector(bias)


def _w4a4_partition(op: str, activation_specs: Callable, row_shard: Callable) -> Callable:
    """The partition callback of a W4A4 op (operands: its activations, then qweight, wscales, lora_up, α, β):
    the weights' placement decides; unsharded K runs the op on the shard's columns and tokens, sharded K
    ``row_shard``. ``activation_specs(lead, kk)``: the activations' shardings."""

    def partition(bind, params, mesh, arg_shapes):
        activation, *_, qweight, wscales, _, alpha, bias = arg_shapes
        n_axes, k_axes = _w4a4_weight_axes(op, mesh, qweight, wscales)
        lead, nn, kk = _lead(activation, n_axes + k_axes), _entry(n_axes), _entry(k_axes)
        args = (*activation_specs(lead, kk), *_w4a4_weight_specs(nn, kk, alpha, bias))

        def local(*operands):
            if not k_axes:
                return bind(*operands, **params)
            return row_shard(bind, *operands, act_format=params["act_format"], axes=k_axes)

        return mesh, local, NamedSharding(mesh, P(*lead, nn)), _named(mesh, args)

    return partition


def _w4a16_gemm_partition(bind, params, mesh, arg_shapes):
    op = "w4a16_gemm"
    group_size = params["group_size"]
    x, qweight, scales, zeros, g_idx, bias = arg_shapes
    row_axes, k_axes = _dim_axes(qweight)
    scale_k_axes, n_axes = _dim_axes(scales)
    k_axes = k_axes or scale_k_axes
    if row_axes:
        _fail(op, "qweight's rows (N/16 row blocks + the permutation row) cannot follow a sharding of N: keep them "
                  f"replicated (P(None, ...)) and shard scales / zeros / bias on N, got {qweight.sharding.spec}")
    n, k = scales.shape[1], x.shape[-1]
    shards_n, shards_k = _size(mesh, n_axes), _size(mesh, k_axes)
    if n % (w4a16_layout.ATOM_N * shards_n):
        _fail(op, f"N (out_features) must be a multiple of {w4a16_layout.ATOM_N * shards_n} (16-row blocks x "
                  f"{shards_n} shards of {n_axes}), got {n}")
    if k_axes:
        if g_idx.shape[0]:
            _fail(op, "w4a16 weights with act-order (g_idx) cannot be sharded on K: their K order is a global permutation")
        unit = max(w4a16_layout.ATOM_K, group_size)
        if group_size == k or k % (unit * shards_k):
            _fail(op, f"K (in_features) must be a multiple of {unit * shards_k} ({unit}-column blocks / groups x "
                      f"{shards_k} shards of {k_axes}; per-channel weights cannot be sharded on K), got {k}")
    lead, nn, kk = _lead(x, n_axes + k_axes), _entry(n_axes), _entry(k_axes)

    def present(v, spec):
        return spec if v.shape[0] else P(None)

    args = (P(*lead, kk), P(None, kk), P(kk, nn), present(zeros, P(kk, nn)), P(None), present(bias, P(nn)))

    def local(x, qweight, scales, zeros, g_idx, bias):
        if n_axes:
            qweight = w4a16_shard_rows(qweight, lax.axis_index(n_axes), shards_n)
        if not k_axes:
            return bind(x, qweight, scales, zeros, g_idx, bias, **params)
        qweight = qweight.at[-1].set(w4a16_identity_tail(k // shards_k))
        return w4a16_row_shard(bind, x, qweight, scales, zeros, g_idx, bias, group_size=group_size, axes=k_axes)

    return mesh, local, NamedSharding(mesh, P(*lead, nn)), _named(mesh, args)


# --------------------------------------------------------------------------------------------------
# Per-shard code shared with the explicit path (jax_w4a4.sharding)


def _summed_over_shards(
    partial: jax.Array, axes: Axes, bias: jax.Array | None, once: jax.Array | None = None
) -> jax.Array:
    """A row-parallel layer's result from its shard's ``partial`` (in the layer dtype, without β): one fp32
    ``psum`` over ``axes``, then ``once`` (an fp32 term of the whole layer) and β added once."""
    acc = lax.psum(partial.astype(jnp.float32), axes)
    if once is not None:
        acc = acc + once
    if bias is not None and bias.shape[0]:
        acc = acc + bias.astype(jnp.float32)
    return acc.astype(partial.dtype)


def w4a4_linear_row_shard(
    linear: Callable, x, smooth, lora_down, qweight, wscales, lora_up, alpha, bias, *, act_format: str, axes: Axes
) -> jax.Array:
    """One shard of a K-sharded W4A4 layer: the whole layer on the shard's K slice without β (α · its
    partial main product + its share of the low-rank branch, ``(X_s · L_down,s) · L_up``: both are sums
    over K), one fp32 ``psum`` over ``axes``, β once. ``linear`` takes the operands of ``w4a4_linear``
    (the primitive's bind or :func:`jax_w4a4.ops.w4a4_linear`); ``alpha`` / ``bias`` may be None or empty."""
    alpha = jnp.zeros((0,), jnp.float32) if alpha is None else alpha
    no_bias = jnp.zeros((0,), wscales.dtype)
    partial = linear(x, smooth, lora_down, qweight, wscales, lora_up, alpha, no_bias, act_format=act_format)
    return _summed_over_shards(partial, axes, bias)


def w4a4_row_shard(
    gemm: Callable, q_x, s_x, la, qweight, wscales, lora_up, alpha, bias, *, act_format: str, axes: Axes
) -> jax.Array:
    """One shard of a K-sharded W4A4 GEMM whose ``la`` is already summed over the shards: the partial main
    product (rank 0, no bias, α applied), an fp32 ``psum`` over ``axes``, then ``LA · L_up`` and β once.
    ``gemm`` takes the operands of ``w4a4_gemm``; ``alpha`` / ``bias`` may be None or empty."""
    out_dtype = wscales.dtype
    alpha = jnp.zeros((0,), jnp.float32) if alpha is None else alpha
    partial = gemm(
        q_x, s_x, la[..., :0], qweight, wscales, lora_up[:0], alpha, jnp.zeros((0,), out_dtype), act_format=act_format
    )
    lowrank = reference._lowrank(la, lora_up, out_dtype) if lora_up.shape[0] else None
    return _summed_over_shards(partial, axes, bias, lowrank)


def w4a16_row_shard(
    gemm: Callable, x, qweight, scales, zeros, g_idx, bias, *, group_size: int, axes: Axes
) -> jax.Array:
    """One shard of a K-sharded W4A16 GEMM: the partial product without bias, one fp32 ``psum`` over
    ``axes``, β once. ``qweight`` holds the shard's K words with its own identity permutation row."""
    partial = gemm(x, qweight, scales, zeros, g_idx, jnp.zeros((0,), x.dtype), group_size=group_size)
    return _summed_over_shards(partial, axes, bias)


def w4a16_identity_tail(k: int) -> jax.Array:
    """The permutation row of a prepacked w4a16 array of ``k`` columns without act-order: words
    ``[0, k)`` the identity, word ``k`` (the act-order flag) and the rest 0."""
    return jnp.zeros((2 * k,), jnp.int32).at[:k].set(jnp.arange(k, dtype=jnp.int32))


def w4a16_shard_rows(qweight: jax.Array, index: jax.Array | int, shards: int) -> jax.Array:
    """Shard ``index``'s row blocks of a prepacked ``(N/16 + 1, 2K)`` array, plus the permutation row."""
    per_shard = (qweight.shape[0] - 1) // shards
    rows = lax.dynamic_slice_in_dim(qweight, index * per_shard, per_shard, axis=0)
    return jnp.concatenate([rows, qweight[-1:]], axis=0)


# --------------------------------------------------------------------------------------------------
# The lowering


RULES: dict[str, Callable[..., SdyShardingRule]] = {
    "act_quant": _act_quant_rule,
    "w4a4_gemm": _w4a4_gemm_rule,
    "w4a4_linear": _w4a4_linear_rule,
    "w4a16_gemm": _w4a16_gemm_rule,
}
OPERANDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # (operand names, the activations)
    "act_quant": (("x", "smooth", "lora_down"), ("x",)),
    "w4a4_gemm": (("q_x", "s_x", "la", "qweight", "wscales", "lora_up", "alpha", "bias"), ("q_x", "s_x", "la")),
    "w4a4_linear": (("x", "smooth", "lora_down", "qweight", "wscales", "lora_up", "alpha", "bias"), ("x",)),
    "w4a16_gemm": (("x", "qweight", "scales", "zeros", "g_idx", "bias"), ("x",)),
}
PARTITIONS: dict[str, Callable] = {
    "act_quant": _act_quant_partition,
    "w4a4_gemm": _w4a4_partition(  # q_x, s_x, la
        "w4a4_gemm", lambda lead, kk: (P(*lead, kk), P(*lead, kk), P(*lead, None)), w4a4_row_shard
    ),
    "w4a4_linear": _w4a4_partition(  # x, smooth, lora_down
        "w4a4_linear", lambda lead, kk: (P(*lead, kk), P(kk), P(kk, None)), w4a4_linear_row_shard
    ),
    "w4a16_gemm": _w4a16_gemm_partition,
}


def _spans_devices(ctx: mlir.LoweringRuleContext) -> bool:
    """Whether this lowering is of a ``jax.jit`` over several devices (not a shard_map body, not one device)."""
    axis_context = ctx.module_context.axis_context
    return isinstance(axis_context, sharding_impls.ShardingContext) and axis_context.num_devices > 1


def partitioned_lowering(name: str, bind: Callable, local_lowering: Callable, multiple_results: bool) -> Callable:
    """The lowering rule of op ``name``: ``local_lowering`` on one device or inside ``shard_map``; over
    several devices, a ``custom_partitioning`` call with the op's Shardy rule and partition callback,
    whose per-device computation binds the primitive again (and so lowers locally)."""
    rule, partition = RULES[name], PARTITIONS[name]

    def body(static: tuple[tuple[str, Any], ...], *operands):
        return bind(*operands, **dict(static))

    def sharding_rule(static, mesh, operand_types, result_types):
        del mesh, result_types
        return rule([tuple(mlir.ir.ShapedType(t).shape) for t in operand_types], **dict(static))

    def partition_call(static, mesh, arg_shapes, result_shape):
        del result_shape  # the callbacks choose the result sharding from the operands'
        mesh, local, result_sharding, arg_shardings = partition(bind, dict(static), mesh, _decode(name, mesh, arg_shapes))

        def per_device(*operands):
            # Traced while XLA compiles, maybe under a jax.set_mesh context: the per-device code must
            # not see that mesh (it would add sharding annotations to a module that is all manual).
            with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
                return local(*operands)

        return mesh, per_device, result_sharding, arg_shardings

    partitioned = custom_partitioning(body, static_argnums=(0,))
    partitioned.def_partition(partition_call, sharding_rule=sharding_rule, decode_shardings=False)

    def lowering(ctx, *operands, **params):
        if not _spans_devices(ctx):
            return local_lowering(ctx, *operands, **params)
        call = functools.partial(partitioned, tuple(sorted(params.items())))
        return mlir.lower_fun(call, multiple_results=multiple_results)(ctx, *operands)

    return lowering
