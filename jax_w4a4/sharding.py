"""Tensor-parallel quantized linears: column / row parallel layers on ``jax.shard_map``.

Two styles over one mesh axis (``axis``, default ``"tensor"``); every other mesh axis (e.g. ``"data"``)
stays automatic, so the token dims of ``x`` may be sharded on it, evenly or not:

* **column parallel** shards N. Every shard holds whole 64-row blocks (svdq) / 16-row blocks (w4a16)
  of the packed weights, its rows of the group scales, its columns of ``lora_up``, α and β; ``x``,
  ``smooth`` and ``lora_down`` are replicated. Each shard runs the unsharded :func:`jax_w4a4.linear`
  on its columns (activation quantization included, redundantly), so the output, sharded on N, is the
  unsharded result column for column. No communication.
* **row parallel** shards K. Every shard holds whole K-blocks of the packed weights, its K-stages of
  the group scales, ``smooth`` and ``lora_down`` rows; ``x`` is sharded on K (the output of a column
  parallel layer is). Activation groups (64 for int4 / uint4, 128 for fp8) never straddle a shard, so
  ``act_quant`` on the local slice gives exactly the unsharded codes and scales. Each shard runs the
  whole layer on its K slice without β (:func:`jax_w4a4.ops.w4a4_linear`, the one FFI call: α times
  its partial main product — α distributes over the sum — plus its share of the low-rank branch,
  ``(X_s · L_down,s) · L_up``, also a sum over K); the partials are summed in **one** fp32 all-reduce
  and β is added once. w4a16: partial ``w4a16_gemm`` without bias, one fp32 all-reduce, β added once.
  So a row-parallel layer costs exactly :data:`ROW_PARALLEL_ALL_REDUCES` = 1 all-reduce.

  Numerics: the primitives return the layer dtype (bf16 / fp16), so each shard's partial is rounded
  to it once before the fp32 sum, and each shard's ``LA_s`` is rounded to it for its product with
  ``L_up``; the unsharded layer rounds only the final sum and ``LA``. The difference is bounded by half
  an ulp of every partial and of every ``|LA_s|·|L_up|`` plus one of the output (the tests assert that
  bound, and that the result equals an fp32 sum of the per-shard partials up to fp32 summation
  order). The activation codes and scales and β are identical.

**Layouts.** svdq weights shard as they are: the prepacked ``(N/64, K/64, 2048)`` array splits along
its N-block axis (column) or K-block axis (row), the prepacked scales ``(K/128, N, 2)`` along N or their
K-stage axis. The w4a16 prepacked array ``(N/16 + 1, 2K)`` has one
tail row (the act-order permutation) that every shard needs its own copy of, so :func:`shard_weights`
re-lays it out at placement time, moving words only (no re-quantization):

* column: the per-shard prepacked arrays (row blocks of the shard + a copy of the tail row) stacked
  along the row axis: ``(S · (N/(16 S) + 1), 2K)``, sharded on rows. Act-order works (K is whole).
* row: the same ``(N/16 + 1, 2K)`` shape, sharded on the word axis: each shard's words of every row
  block are its K-atoms, and its slice of the tail row is the identity permutation of its ``K/S``
  columns. **Act-order (``g_idx``) is rejected for row parallel**: the stored K order is a global
  permutation, so a shard's contiguous slice of ``x`` would need columns of other shards.

Because the w4a16 arrays no longer form a valid global layout, and because the row-parallel
algorithm (partial layers without β, one all-reduce, β once) is a choice no sharding
propagation derives, the placement is carried as metadata: :func:`shard_weights` returns a
:class:`TensorParallelWeights` pytree (the local weights + static mesh, axis and style).

**Two paths.** This module is the *explicit* one: :func:`jax_w4a4.linear` dispatches a
:class:`TensorParallelWeights` to :func:`tensor_parallel_linear`, a ``shard_map`` manual over the
tensor axis only, so under plain ``jax.jit`` (or ``nnx.jit``) weights placed by :func:`shard_weights` /
:func:`shard_model` run tensor parallel whatever the partitioner. The *automatic* path needs no
placement helper: plain ``SVDQuantWeights`` / ``W4A16Weights`` whose arrays the user placed with
``NamedSharding`` partition themselves under ``jax.jit``, through the Shardy sharding rules and
``custom_partitioning`` callbacks of :mod:`jax_w4a4.ops.partitioning` (why that mechanism, and why at
the primitives' lowering: see there). Both run the same per-shard code (the row-parallel partial
layers, psum and β of :func:`~jax_w4a4.ops.partitioning.w4a4_linear_row_shard` /
:func:`~jax_w4a4.ops.partitioning.w4a16_row_shard`) and cost the same: no weight all-gather, one
all-reduce per row layer. The explicit path keeps what the automatic one cannot have: the w4a16
re-layout above (by hand, ``qweight``'s rows stay replicated and each call copies its share).

Alignment (checked at placement, ValueError naming the argument): column needs N a multiple of
``64 S`` (svdq) / ``16 S`` (w4a16); row needs K a multiple of ``128 S`` (svdq: the 128-column stages of
the prepacked scales, which also hold whole activation groups), or ``S · max(64, group_size)`` (w4a16;
per-channel w4a16 cannot be row parallel).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_w4a4 import ops
from jax_w4a4.formats import svdq_layout, w4a16_layout
from jax_w4a4.ops import partitioning
from jax_w4a4.weights import SVDQuantWeights, W4A16Weights

Style = Literal["column", "row"]
STYLES: tuple[str, ...] = ("column", "row")
ROW_PARALLEL_ALL_REDUCES = 1  # per row-parallel layer: the fp32 sum of the partial outputs
ShardableWeights = SVDQuantWeights | W4A16Weights


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TensorParallelWeights:
    """Quantized weights placed for tensor parallelism (made by :func:`shard_weights`).

    Attributes:
      weights: the ``SVDQuantWeights`` / ``W4A16Weights`` whose arrays are sharded over ``mesh``
        (w4a16: ``qweight`` in the per-shard layout of the module docstring, not a global layout).
      mesh: the device mesh. Static.
      axis: the mesh axis that shards N (column) or K (row). Static.
      style: ``"column"`` or ``"row"``. Static.
    """

    weights: ShardableWeights
    mesh: Mesh = dataclasses.field(metadata=dict(static=True))
    axis: str = dataclasses.field(default="tensor", metadata=dict(static=True))
    style: str = dataclasses.field(default="column", metadata=dict(static=True))

    @property
    def in_features(self) -> int:
        return self.weights.in_features

    @property
    def out_features(self) -> int:
        return self.weights.out_features

    @property
    def dtype(self) -> jnp.dtype:
        return self.weights.dtype

    @property
    def bias(self) -> jax.Array | None:
        return self.weights.bias

    @property
    def shards(self) -> int:
        return self.mesh.shape[self.axis]


def _fail(message: str) -> None:
    raise ValueError(f"jax_w4a4.shard_weights: {message}")


def _check_multiple(name: str, size: int, block: int, shards: int, what: str) -> None:
    if size % (block * shards):
        _fail(
            f"{name} must be a multiple of {block * shards} ({what} x {shards} shards of the mesh axis) "
            f"so that shard boundaries align with {what}, got {size}"
        )


def _check_alignment(weights: ShardableWeights, style: str, shards: int) -> None:
    n, k = weights.out_features, weights.in_features
    if isinstance(weights, SVDQuantWeights):
        if style == "column":
            _check_multiple("N (out_features)", n, svdq_layout.BLOCK_N, shards, "64-row svdq blocks")
        else:
            stage = svdq_layout.KERNEL_K_MULTIPLE
            _check_multiple("K (in_features)", k, stage, shards, f"{stage}-column stages of the weight scales")
        return
    if style == "column":
        _check_multiple("N (out_features)", n, w4a16_layout.ATOM_N, shards, "16-row w4a16 blocks")
        return
    if weights.g_idx is not None:
        _fail("w4a16 weights with act-order (g_idx) cannot be row parallel: use style='column'")
    block = max(w4a16_layout.ATOM_K, weights.group_size)
    _check_multiple("K (in_features)", k, block, shards, f"w4a16 {block}-column blocks / groups")


def _column_w4a16_qweight(qweight: jax.Array, shards: int) -> jax.Array:
    """Global prepacked ``(nb + 1, 2K)`` -> per-shard arrays (row blocks + tail copy) stacked on rows."""
    return jnp.concatenate([partitioning.w4a16_shard_rows(qweight, s, shards) for s in range(shards)])


def _row_w4a16_qweight(qweight: jax.Array, k: int, shards: int) -> jax.Array:
    """Global prepacked ``(nb + 1, 2K)`` without act-order -> the same shape whose tail row holds, in
    every shard's word slice, the identity permutation of the shard's ``K/S`` columns (flag 0)."""
    return qweight.at[-1].set(jnp.tile(partitioning.w4a16_identity_tail(k // shards), shards))


def _specs(weights: ShardableWeights, style: str, axis: str) -> ShardableWeights:
    """The PartitionSpec of every array of the (re-laid-out) weights, in a pytree like ``weights``."""
    col = style == "column"
    if isinstance(weights, SVDQuantWeights):
        vec = P(axis) if col else P()
        specs = dict(
            qweight=P(axis, None, None) if col else P(None, axis, None),
            wscales=P(None, axis, None) if col else P(axis, None, None),
            smooth=P() if col else P(axis),
            lora_down=P() if col else P(axis, None),
            lora_up=P(None, axis) if col else P(),
            alpha=vec,
            bias=vec,
        )
    else:
        matrix = P(axis, None) if col else P(None, axis)  # qweight (N row blocks, K words)
        transposed = P(None, axis) if col else P(axis, None)  # scales / zeros (K/G, N)
        specs = dict(qweight=matrix, scales=transposed, zeros=transposed, g_idx=P(), bias=P(axis) if col else P())
    return dataclasses.replace(
        weights, **{name: None if getattr(weights, name) is None else spec for name, spec in specs.items()}
    )


def shard_weights(
    weights: ShardableWeights, mesh: Mesh, *, style: Style = "column", axis: str = "tensor"
) -> TensorParallelWeights:
    """Places quantized weights on ``mesh`` for a column- or row-parallel layer.

    Args:
      weights: ``SVDQuantWeights`` (svdq-int4 / w4a8) or ``W4A16Weights``, as :func:`quantize_linear`
        or :mod:`jax_w4a4.quantize` make them (global layouts).
      mesh: the device mesh; ``axis`` must be one of its axes (others replicate the weights).
      style: ``"column"`` (shard N) or ``"row"`` (shard K).
      axis: the mesh axis name to shard over.

    Returns:
      :class:`TensorParallelWeights` that :func:`jax_w4a4.linear` runs tensor parallel.

    Raises:
      ValueError: unknown style / axis, or shard boundaries that would split a block or group
        (the message names the dimension and the multiple it needs).
    """
    if style not in STYLES:
        _fail(f"style must be one of {STYLES}, got {style!r}")
    if axis not in mesh.axis_names:
        _fail(f"axis must be one of the mesh axes {tuple(mesh.axis_names)}, got {axis!r}")
    if not isinstance(weights, (SVDQuantWeights, W4A16Weights)):
        raise TypeError(
            f"jax_w4a4.shard_weights: weights must be SVDQuantWeights or W4A16Weights, got {type(weights).__name__}"
        )
    shards = mesh.shape[axis]
    _check_alignment(weights, style, shards)
    if isinstance(weights, W4A16Weights):
        qweight = (
            _column_w4a16_qweight(weights.qweight, shards)
            if style == "column"
            else _row_w4a16_qweight(weights.qweight, weights.in_features, shards)
        )
        weights = dataclasses.replace(weights, qweight=qweight)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), _specs(weights, style, axis))
    return TensorParallelWeights(jax.device_put(weights, shardings), mesh=mesh, axis=axis, style=style)


def _row_parallel_local(x: jax.Array, w: ShardableWeights, axis: str) -> jax.Array:
    """One shard of a row-parallel layer: the partial layer, one fp32 all-reduce, β once."""
    if isinstance(w, SVDQuantWeights):  # (K is not padded: the alignment of K makes it a multiple of 128)
        return w.crop_output(partitioning.w4a4_linear_row_shard(
            ops.w4a4_linear, x, w.smooth, w.lora_down, w.qweight, w.wscales, w.lora_up, w.alpha, w.bias,
            act_format=w.act_format, axes=(axis,),
        ))
    return partitioning.w4a16_row_shard(
        ops.w4a16_gemm, x, w.qweight, w.scales, w.zeros, None, w.bias, group_size=w.group_size, axes=(axis,)
    )


def _axes_of(spec: tuple) -> set[str]:
    return {a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)}


def _explicit_lead_spec(x: jax.Array, axis: str) -> tuple:
    """The explicit-axis sharding of x's token dims (sharding in types), else all None.

    Explicit axes of x's token dims are made manual too: the primitives' abstract evaluation carries
    no sharding, so leaving them automatic would gather x along them.
    """
    spec = tuple(jax.typeof(x).sharding.spec)
    lead = (spec + (None,) * x.ndim)[: x.ndim - 1]
    if axis in _axes_of(lead):
        raise ValueError(
            f"jax_w4a4.linear: x's token dims must not be sharded on the tensor axis {axis!r}, got {P(*spec)}"
        )
    return lead


def tensor_parallel_linear(x: jax.Array, weights: TensorParallelWeights) -> jax.Array:
    """``linear(x, weights)`` for placed weights: a ``shard_map`` manual over ``weights.axis`` only.

    Column: ``x`` replicated over the axis, output ``(..., N)`` sharded on N. Row: ``x`` sharded on K
    (its last dim), output replicated over the axis. Other mesh axes stay automatic (``x``'s token
    dims may be sharded on them). Inputs are checked by :func:`jax_w4a4.linear`.
    """
    from jax_w4a4.linear import linear  # noqa: PLC0415  (linear dispatches here)

    axis, lead = weights.axis, _explicit_lead_spec(x, weights.axis)
    specs = _specs(weights.weights, weights.style, axis)
    if weights.style == "column":
        x_spec, out_spec = P(*lead, None), P(*lead, axis)
        local = linear
    else:
        x_spec, out_spec = P(*lead, axis), P(*lead, None)

        def local(x_s, w_s):
            return _row_parallel_local(x_s, w_s, axis)

    mapped = jax.shard_map(
        local, mesh=weights.mesh, in_specs=(x_spec, specs), out_specs=out_spec,
        axis_names={axis, *_axes_of(lead)},
        check_vma=False,  # the primitives' reference lowerings carry no varying-axis types
    )
    if jax.typeof(x).sharding.mesh.explicit_axes:  # sharding in types: x must already match x_spec
        x = jax.sharding.reshard(x, NamedSharding(weights.mesh, x_spec))
    return mapped(x, weights.weights)


def shard_model(model: Any, mesh: Mesh, rules: Mapping[str, Style | None], *, axis: str = "tensor") -> Any:
    """Places the weights of a model's ``QuantizedLinear`` layers for tensor parallelism, in place.

    Args:
      model: an ``nnx.Module`` tree with :class:`jax_w4a4.nn.QuantizedLinear` layers.
      mesh: the device mesh. axis: its tensor-parallel axis.
      rules: layer path pattern -> ``"column"``, ``"row"`` or None (leave the layer as it is); the
        patterns and first-match order of :func:`jax_w4a4.nn.quantize_model` (globs, ``"re:..."``).

    Returns:
      ``model`` (modified in place). Warns about rules that match no QuantizedLinear.
    """
    from flax import nnx  # noqa: PLC0415  (flax is needed only for models)

    from jax_w4a4.nn.linear import QuantizedArray, QuantizedLinear  # noqa: PLC0415
    from jax_w4a4.nn.model import path_string, rule_matches  # noqa: PLC0415

    for style in rules.values():
        if style is not None and style not in STYLES:
            _fail(f"rules values must be one of {STYLES} or None, got {style!r}")
    used: set[str] = set()
    for path, node in list(nnx.iter_graph(model)):
        if not isinstance(node, QuantizedLinear):
            continue
        name = path_string(path)
        pattern = next((p for p in rules if rule_matches(p, name)), None)
        if pattern is None:
            continue
        used.add(pattern)
        weights = node.quantized_weights
        if rules[pattern] is None or isinstance(weights, TensorParallelWeights):
            continue
        placed = shard_weights(weights, mesh, style=rules[pattern], axis=axis)
        node.weights = nnx.data(jax.tree.map(QuantizedArray, placed))
    unused = [p for p in rules if p not in used]
    if unused:
        warnings.warn(f"jax_w4a4.shard_model: rules matching no QuantizedLinear: {unused}", stacklevel=2)
    return model
