"""The CUDA kernels' shared-memory plans, solved at compile time, as Python sees them (W4A4 GEMM, act_quant, w4a16 GEMM).

    python -m jax_w4a4.budget                    # prints every plan the kernels instantiate
    python -m jax_w4a4.budget w4a16 1 8192 4096  # how one w4a16 call of that shape is launched
    python -m jax_w4a4.budget act_quant 4096 4096 --rank 32

The plans live in host-compilable C++ headers (``csrc/kernels/sm90/*_plan.h``) that the kernels
static_assert; ``libjax_w4a4_budget.so`` (host-only, built on every machine) exposes them here, so the
table printed is the one compiled. One row per object in shared memory: bytes per buffer, stages,
per-CTA footprint (replicated under TMA multicast), bytes this CTA issues (split under multicast), and
the bytes a stage's full barrier expects (always the whole tile).

With ``$JAX_W4A4_LIBRARY`` naming a build that has its planner library beside it, that planner is the one
used (``library_path``), so the workspaces the ops size are the ones that build's handlers expect.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import functools
import os
from pathlib import Path

from jax_w4a4.ops._library import ENV_LIBRARY, find_shared_library

LIBRARY_NAME = "libjax_w4a4_budget.so"


class Sharing(enum.IntEnum):
    PRIVATE = 0
    MULTICAST = 1


class Lifetime(enum.IntEnum):
    MAIN_LOOP = 0
    LOW_RANK = 1
    EPILOGUE = 2
    KERNEL = 3


@dataclasses.dataclass(frozen=True)
class SmemObject:
    name: str
    bytes: int
    stages: int
    sharing: Sharing
    lifetime: Lifetime
    footprint: int
    issued_bytes: int
    expected_tx_bytes: int


@dataclasses.dataclass(frozen=True)
class W4A4Plan:
    tile_n: int
    tile_m: int
    cluster: int
    lora_chunk: int
    act_value_bits: int
    expanded_weights: bool
    main_stages: int
    lora_stages: int
    total_bytes: int
    main_stage_bytes: int
    main_stage_tx_bytes: int
    main_stage_issued_bytes: int
    ctas_per_sm: int
    smem_limit: int  # plan bytes one CTA may use (its share of the SM, less the 1 KB alignment slack)
    objects: tuple[SmemObject, ...]

    def object(self, name: str) -> SmemObject:
        return next(o for o in self.objects if o.name.startswith(name))


SMEM_PER_BLOCK = 227 * 1024
_OBJECT_FIELDS = 7
_HEADER_FIELDS = 8
_MAX_OBJECTS = 32


def library_path() -> Path | None:
    """Where the planner library is: beside the CUDA library that ``$JAX_W4A4_LIBRARY`` names when one is there (a
    build's handlers check the workspaces against their own plans), else next to the package, else ``build/``."""
    forced = os.environ.get(ENV_LIBRARY)
    if forced:
        beside = Path(forced).with_name(LIBRARY_NAME)
        if beside.is_file():
            return beside
    return find_shared_library(LIBRARY_NAME)


@functools.cache
def _load() -> ctypes.CDLL:
    path = library_path()
    if path is None:
        raise RuntimeError(f"{LIBRARY_NAME} is not built: install the package (pip install .) or run CMake")
    lib = ctypes.cdll.LoadLibrary(str(path))
    lib.JaxW4a4BudgetTable.restype = ctypes.c_char_p
    lib.JaxW4a4W4A4ObjectName.restype = ctypes.c_char_p
    lib.JaxW4a4W4A4Plan.restype = ctypes.c_int
    lib.JaxW4a4W4A4Plan.argtypes = [ctypes.c_int] * 6 + [ctypes.POINTER(ctypes.c_int64)]
    lib.JaxW4a4W4A4ObjectName.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.JaxW4a4ActQuantShapes.restype = ctypes.c_int
    lib.JaxW4a4ActQuantShapes.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.JaxW4a4ActQuantPlan.restype = None
    lib.JaxW4a4ActQuantPlan.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
    lib.JaxW4a4ActQuantLaunch.restype = None
    lib.JaxW4a4ActQuantLaunch.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
    lib.JaxW4a4W4a16MTiles.restype = ctypes.c_int
    lib.JaxW4a4W4a16MTiles.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.JaxW4a4W4a16Plan.restype = None
    lib.JaxW4a4W4a16Plan.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
    lib.JaxW4a4W4a16Launch.restype = None
    lib.JaxW4a4W4a16Launch.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_int] * 2 + [ctypes.POINTER(ctypes.c_int64)]
    lib.JaxW4a4W4a16SplitGranule.restype = ctypes.c_int
    lib.JaxW4a4W4a16SplitGranule.argtypes = [ctypes.c_int]
    lib.JaxW4a4W4a16WorkspaceBytes.restype = ctypes.c_int64
    lib.JaxW4a4W4a16WorkspaceBytes.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_int] * 2
    lib.JaxW4a4W4A4ExpandedWeightsMinTokens.restype = ctypes.c_int64
    lib.JaxW4a4W4A4ExpandedWeightsMinTokens.argtypes = []
    lib.JaxW4a4W4A4LaunchTile.restype = None
    lib.JaxW4a4W4A4LaunchTile.argtypes = [ctypes.c_int64] * 2 + [ctypes.c_int] * 2 + [ctypes.POINTER(ctypes.c_int64)]
    lib.JaxW4a4W4a4WorkspaceBytes.restype = ctypes.c_int64
    lib.JaxW4a4W4a4WorkspaceBytes.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.JaxW4a4ArrivalCounterLimits.restype = None
    lib.JaxW4a4ArrivalCounterLimits.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    return lib


def table() -> str:
    """The plan of every kernel configuration compiled into the library, as a text table."""
    return _load().JaxW4a4BudgetTable().decode()


def w4a4_plan(
    tile_n: int,
    tile_m: int,
    cluster: int,
    lora_chunk: int = 64,
    act_value_bits: int = 8,
    expanded_weights: bool = False,
) -> W4A4Plan:
    """The solved shared-memory plan of the sm90 W4A4 GEMM for one tile shape; ``expanded_weights``: the
    prefill instance that reads e4m3 weights expanded before the GEMM (:func:`w4a4_expanded_weights_min_tokens`)."""
    lib = _load()
    out = (ctypes.c_int64 * (_HEADER_FIELDS + _OBJECT_FIELDS * _MAX_OBJECTS))()
    count = lib.JaxW4a4W4A4Plan(tile_n, tile_m, cluster, lora_chunk, act_value_bits, int(expanded_weights), out)
    values = list(out)
    objects = []
    for i in range(count):
        b, st, sh, lt, fp, iss, tx = values[_HEADER_FIELDS + _OBJECT_FIELDS * i : _HEADER_FIELDS + _OBJECT_FIELDS * (i + 1)]
        name = lib.JaxW4a4W4A4ObjectName(i, int(expanded_weights)).decode()
        objects.append(SmemObject(name, b, st, Sharing(sh), Lifetime(lt), fp, iss, tx))
    return W4A4Plan(
        tile_n, tile_m, cluster, lora_chunk, act_value_bits, expanded_weights, *values[:_HEADER_FIELDS], tuple(objects)
    )


SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_CTA = 1024
REGISTERS_PER_SM = 64 * 1024


@dataclasses.dataclass(frozen=True)
class ActQuantPlan:
    """The sm90 act_quant plan of one instance (csrc/kernels/sm90/act_quant_plan.h): a CTA of
    ``block_rows`` rows; per 128-wide K chunk (one ring stage) the X tile, the L_down tile and the next
    chunk's lambdas, with a full mbarrier (``barrier_bytes``); ``ctas_per_sm`` CTAs designed to share an SM.
    ``total_bytes`` includes 1 KB that aligns the X and L_down tiles for their swizzle."""

    block_rows: int
    rank_cap: int
    warps: int
    threads: int
    ctas_per_sm: int
    units_per_pass: int
    passes: int
    stages: int
    x_tile_bytes: int
    lambda_bytes: int
    lora_row_pitch: int
    lora_tile_bytes: int
    stage_bytes: int
    ring_bytes: int
    column_table_bytes: int
    barrier_bytes: int
    total_bytes: int
    per_sm_bytes: int
    max_registers: int
    fits: bool


_ACT_QUANT_FIELDS = 18


def act_quant_shapes() -> list[tuple[int, int]]:
    """(block_rows, rank_cap) of every act_quant instance the launcher dispatches to."""
    out = (ctypes.c_int64 * 64)()
    n = _load().JaxW4a4ActQuantShapes(out)
    return [(int(out[2 * i]), int(out[2 * i + 1])) for i in range(n)]


def act_quant_plan(block_rows: int, rank_cap: int) -> ActQuantPlan:
    """The solved shared-memory / occupancy plan of the sm90 act_quant kernel for one instance."""
    out = (ctypes.c_int64 * _ACT_QUANT_FIELDS)()
    _load().JaxW4a4ActQuantPlan(block_rows, rank_cap, out)
    values = [int(v) for v in out]
    return ActQuantPlan(block_rows, rank_cap, *values[:-1], bool(values[-1]))


@dataclasses.dataclass(frozen=True)
class ActQuantLaunch:
    """How one act_quant call is launched for ``num_sms`` SMs (PlanActQuantLaunch in act_quant_plan.h): the
    instance (``block_rows``, ``rank_cap``), a grid of ``row_blocks`` x ``k_splits`` CTAs, and what a K split
    with a low-rank branch needs: one arrival counter per row block (the library's self-re-arming counters,
    csrc/common/arrival_counters.h) and fp32 LA partials (the workspace)."""

    block_rows: int
    rank_cap: int
    row_blocks: int
    k_splits: int
    arrival_counters: int
    workspace_bytes: int


def act_quant_launch(rows: int, k: int, rank: int, *, num_sms: int) -> ActQuantLaunch:
    """The sm90 act_quant launch plan of an (rows, K) input with a rank-``rank`` down projection."""
    out = (ctypes.c_int64 * 6)()
    _load().JaxW4a4ActQuantLaunch(rows, k, rank, num_sms, out)
    return ActQuantLaunch(*(int(v) for v in out))


@dataclasses.dataclass(frozen=True)
class ArrivalCounterLimits:
    """Each kernel's pool of self-re-arming arrival counters (csrc/common/arrival_counters.h), which the
    split-K and stream-K reductions use instead of a zeroed workspace: ``counters`` per kernel, enough for
    every launch planned for at most ``max_num_sms`` SMs."""

    counters: int
    max_num_sms: int


def arrival_counter_limits() -> ArrivalCounterLimits:
    """The arrival-counter pool's sizes, as compiled."""
    out = (ctypes.c_int64 * 2)()
    _load().JaxW4a4ArrivalCounterLimits(out)
    return ArrivalCounterLimits(*(int(v) for v in out))


@dataclasses.dataclass(frozen=True)
class W4a16Plan:
    """The sm90 w4a16 GEMM plan of one token tile (csrc/kernels/sm90/w4a16_gemm_plan.h): per ring stage
    (``stage_atoms`` 64-wide K atoms) 512 B of prepacked weights per atom and m16 tile (wide: 8 warps x
    ``tiles_per_warp`` tiles; narrow: one warp's), the X tile of each atom (128-byte swizzled rows, the wgmma
    B operand) and the scales and zero points of the stage's groups (up to two an atom), one TMA box each,
    with a full and an empty mbarrier; fixed: 1 KB of slack that aligns the base to the swizzle atom and,
    narrow, ``cluster_sum_bytes``: the slots where the other CTAs of a K-split cluster put their accumulators
    (up to 3 warps' worth) and their mbarrier; ``ctas_per_sm`` CTAs designed to share an SM. Narrow CTAs end with
    a sum over their k-lanes: every lane past the first puts its accumulators (a warp's) in ``lane_sum_bytes``
    of the ring, which the plan fits only if they fit there. ``form`` (see
    ``W4A16_FORMS``): "wide"; "whole", one CTA per SM of row warps (up to 16 with 4 m16 tiles each at the
    one-token tile, 8 with 8 at the 16-token tile, 8 with 4 at the 32-token tile); "whole7", the same with 7
    tiles a warp at the 16-token tile; "narrow" (the mma.sync token tiles), one CTA per SM whose k-lanes share
    one warp's rows (4 m16 tiles, 64 rows), fed by a producer warp; "narrow32", the same with 2 m16 tiles (32
    rows)."""

    m_tiles: int
    form: str
    block_m: int
    ctas_per_sm: int
    max_warps: int
    stage_atoms: int
    tiles_per_warp: int
    block_rows: int
    stages: int
    stage_weight_bytes: int
    stage_x_bytes: int
    stage_scale_bytes: int
    stage_bytes: int
    ring_bytes: int
    barrier_bytes: int
    cluster_sum_bytes: int
    total_bytes: int
    per_sm_bytes: int
    lane_sum_bytes: int
    fits: bool


_W4A16_FIELDS = 18
W4A16_FORMS = ("wide", "whole", "narrow", "narrow32", "whole7")  # W4a16Form in csrc/kernels/sm90/w4a16_gemm_plan.h, in its order


@dataclasses.dataclass(frozen=True)
class W4a16Launch:
    """The launch plan of one w4a16 GEMM (PlanW4a16Launch): ``m_blocks`` x ``n_tiles`` x ``splits`` CTAs of
    ``threads`` threads, of plan ``form`` (``w4a16_plan(m_tiles, form=form)``); wide and whole-SM CTAs ("whole",
    "whole7") own ``warps`` warps' rows (launched as whole warpgroups; where one CTA holds an SM, except "whole" at
    16 tokens, one more warpgroup whose first warp issues the CTA's loads), narrow and narrow32 ones one warp's rows
    shared by ``k_lanes`` warps, each computing runs of ``lane_atoms`` 64-wide atoms of K (wide, whole-SM: 1); an
    unsplit narrow launch from 8 tokens that fills the SMs starts its CTAs' K loops at ``k_phases`` evenly spaced
    stages (by column tile, wrapping around), so that they do not all read the same activations from L2 at once (else
    1). ``splits`` cuts K: wide and
    whole-SM through workspace partials that, for each row warp, the last of its splits to arrive sums
    (``arrival_counters`` of the library's pool: one per token block, column tile and row warp of the form); narrow,
    as one cluster of ``splits`` CTAs whose accumulators rank 0 adds from its shared memory (no workspace, no counters)."""

    m_tiles: int
    m_blocks: int
    warps: int
    n_tiles: int
    splits: int
    form: str
    k_lanes: int
    lane_atoms: int
    k_phases: int
    threads: int
    arrival_counters: int

    @property
    def narrow(self) -> bool:
        """Whether the launch runs narrow CTAs (``form`` "narrow" or "narrow32")."""
        return self.form in ("narrow", "narrow32")


def _w4a16_form_index(form: str) -> int:
    """``form``'s W4a16Form value (its place in ``W4A16_FORMS``); a ValueError naming the forms otherwise."""
    if form not in W4A16_FORMS:
        raise ValueError(f"form must be one of {W4A16_FORMS}, got {form!r}")
    return W4A16_FORMS.index(form)


def w4a16_m_tiles() -> list[int]:
    """The token tiles (in n8 MMA tiles) the w4a16 kernel instantiates."""
    out = (ctypes.c_int64 * 16)()
    n = _load().JaxW4a4W4a16MTiles(out)
    return [int(out[i]) for i in range(n)]


def w4a16_plan(m_tiles: int, *, form: str = "wide") -> W4a16Plan:
    """The solved shared-memory / occupancy plan of the sm90 w4a16 GEMM for one token tile and ``form``
    (``W4A16_FORMS``; the kernel instantiates "narrow" and "narrow32" for the mma.sync tiles, m_tiles <= 2,
    "whole" for m_tiles 1, 2 and 4, and "whole7" for m_tiles 2)."""
    out = (ctypes.c_int64 * _W4A16_FIELDS)()
    _load().JaxW4a4W4a16Plan(m_tiles, _w4a16_form_index(form), out)
    values = [int(v) for v in out]
    return W4a16Plan(m_tiles, form, *values[:-1], bool(values[-1]))


def w4a16_launch(m: int, n: int, k: int, group_size: int, *, act_order: bool, num_sms: int) -> W4a16Launch | None:
    """The launch plan of one w4a16 GEMM planned for ``num_sms`` SMs; None when the kernel does not serve
    the shape."""
    out = (ctypes.c_int64 * 11)()
    _load().JaxW4a4W4a16Launch(m, n, k, group_size, int(act_order), num_sms, out)
    values = [int(v) for v in out]
    if values[0] < 0:
        return None
    return W4a16Launch(*values[:5], W4A16_FORMS[values[5]], *values[6:])


def w4a16_split_granule(form: str) -> int:
    """The 64-wide atoms a K split of a w4a16 launch of ``form`` comes in whole granules of: 1 for wide and
    whole-SM splits; a narrow K-split cluster's ranks split K in granules of 2 atoms (128 columns), so a 4-atom
    stage starts on a 128-wide group."""
    return int(_load().JaxW4a4W4a16SplitGranule(_w4a16_form_index(form)))


def w4a16_workspace_bytes(m: int, n: int, k: int, group_size: int, *, act_order: bool, num_sms: int) -> int:
    """Device workspace of one w4a16 GEMM launch planned for ``num_sms`` SMs (split-K partials and
    the act-order gather of X); -1 when the kernel does not serve the shape."""
    return int(_load().JaxW4a4W4a16WorkspaceBytes(m, n, k, group_size, int(act_order), num_sms))


def w4a4_expanded_weights_min_tokens() -> int:
    """Tokens from which the w4a4 GEMM expands its int4 weights to e4m3 in its workspace before the GEMM
    (N x K bytes a call), so that the prefill tile reads them from shared memory instead of converting them."""
    return int(_load().JaxW4a4W4A4ExpandedWeightsMinTokens())


@dataclasses.dataclass(frozen=True)
class W4A4LaunchTile:
    """The w4a4 GEMM instance one launch runs: its token tile, cluster size and weight path."""

    tile_m: int
    cluster: int
    expanded_weights: bool


def w4a4_launch_tile(m: int, n: int, *, num_sms: int, act_format: str = "int4") -> W4A4LaunchTile:
    """The instance of one w4a4 GEMM launch of ``m`` tokens and ``n`` output columns planned for ``num_sms`` SMs:
    the smallest token tile that holds the tokens (8 to 128), and on expanded weights (from
    :func:`w4a4_expanded_weights_min_tokens`) the 128-token tile, or for int4 / uint4 activations the 256-token tile
    where its rounds over the SMs are no more work (it streams half the weight bytes per token)."""
    from jax_w4a4 import reference  # not at import: jax_w4a4.ops imports this module
    from jax_w4a4.ops import checks

    checks.one_of("budget", "act_format", act_format, reference.ACT_FORMATS)
    out = (ctypes.c_int64 * 3)()
    _load().JaxW4a4W4A4LaunchTile(m, n, num_sms, int(act_format == "fp8"), out)
    return W4A4LaunchTile(int(out[0]), int(out[1]), bool(out[2]))


def w4a4_workspace_bytes(m: int, n: int, k: int, *, num_sms: int) -> int:
    """Device workspace of one w4a4 GEMM launch planned for ``num_sms`` SMs: the e4m3 weights expanded for a
    long prefill (N x K bytes, :func:`w4a4_expanded_weights_min_tokens`); up to 32 tokens the stream-K partials of
    a launch whose column tiles do not divide over the SMs, then the tokens' promotion records (M x K/64 x 8 bytes); else 0."""
    return int(_load().JaxW4a4W4a4WorkspaceBytes(m, n, k, num_sms))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def describe_w4a16_launch(m: int, n: int, k: int, group_size: int, *, act_order: bool, num_sms: int) -> str:
    """How one w4a16 GEMM call is launched, in words: the form, the grid, the rows and K of a CTA, the
    workspace (what ``python -m jax_w4a4.budget w4a16 M N K`` prints)."""
    head = f"w4a16_gemm M={m} N={n} K={k} group {group_size}{' act-order' if act_order else ''} on {num_sms} SMs"
    plan = w4a16_launch(m, n, k, group_size, act_order=act_order, num_sms=num_sms)
    if plan is None:
        return f"{head}: not served (N a multiple of 32, K of 64 and of the group, M >= 1)"
    ctas = plan.m_blocks * plan.n_tiles * plan.splits
    warp_rows = w4a16_plan(plan.m_tiles, form=plan.form).tiles_per_warp * 16  # m16 tiles
    runs = f"{plan.k_lanes} k-lanes in runs of {_count(plan.lane_atoms, 'atom')} and a producer warp"
    if plan.narrow and plan.splits == 1:
        work = f"{warp_rows} rows and all of K a CTA, {runs}: no split-K"
        if plan.k_phases > 1:
            work += f"; the CTAs start K at {plan.k_phases} evenly spaced stages"
    elif plan.narrow:
        work = (f"{warp_rows} rows and 1/{plan.splits} of K a CTA (in granules of "
                f"{_count(w4a16_split_granule(plan.form), 'atom')}), {runs}; clusters of {plan.splits} CTAs add "
                f"through shared memory")
    else:
        producer = ("plus a producer warpgroup" if plan.threads > 128 * -(-plan.warps // 4)
                    else "the last warp's lane 0 also produces")
        work = (f"{plan.warps} row warps ({plan.warps * warp_rows} rows) a CTA ({producer}), K in {plan.splits} "
                f"split(s) of {-(-(k // 64) // plan.splits)} atoms")
        if plan.splits > 1:
            work += f"; the last of a row warp's splits sums its rows ({plan.arrival_counters} arrival counters)"
    workspace = w4a16_workspace_bytes(m, n, k, group_size, act_order=act_order, num_sms=num_sms)
    return (f"{head}: {plan.form} plan, {8 * plan.m_tiles}-token tile\n"
            f"  {ctas} CTAs ({plan.m_blocks} token block(s) x {plan.n_tiles} column tiles x {plan.splits} split(s)) "
            f"of {plan.threads} threads\n  {work}\n  workspace {workspace} bytes")


def describe_w4a4_launch(m: int, n: int, k: int, *, num_sms: int, act_format: str = "int4") -> str:
    """How one w4a4 GEMM call is launched, in words: the instance and the workspace (what ``python -m
    jax_w4a4.budget w4a4 M N K`` prints)."""
    from jax_w4a4.ops import checks  # not at import: jax_w4a4.ops imports this module

    if m < 1:
        checks.fail("budget", f"M must be at least 1, got {m}")
    checks.multiple_of("budget", "N", n, 128, " (the GEMM's column tile)")
    checks.multiple_of("budget", "K", k, 128, " (the GEMM's K stage)")
    tile = w4a4_launch_tile(m, n, num_sms=num_sms, act_format=act_format)
    weights = "e4m3 weights expanded into the workspace first" if tile.expanded_weights else "int4 weights"
    return (f"w4a4_gemm M={m} N={n} K={k} {act_format} on {num_sms} SMs: {tile.tile_m}-token tile, clusters of "
            f"{tile.cluster}, {weights}\n  workspace {w4a4_workspace_bytes(m, n, k, num_sms=num_sms)} bytes")


def describe_act_quant_launch(rows: int, k: int, rank: int, *, num_sms: int) -> str:
    """How one act_quant call is launched, in words (what ``python -m jax_w4a4.budget act_quant ROWS K``
    prints)."""
    from jax_w4a4.ops import checks  # not at import: jax_w4a4.ops imports this module

    if rows < 1:
        checks.fail("budget", f"rows must be at least 1, got {rows}")
    checks.multiple_of("budget", "K", k, 64, " (act_quant's int4 group; fp8 needs 128)")
    checks.rank("budget", "rank", rank)
    plan = act_quant_launch(rows, k, rank, num_sms=num_sms)
    return (f"act_quant rows={rows} K={k} rank {rank} on {num_sms} SMs: instance of {plan.block_rows} rows, "
            f"rank cap {plan.rank_cap}\n  {plan.row_blocks * plan.k_splits} CTAs ({plan.row_blocks} row blocks x "
            f"{plan.k_splits} K split(s)), {plan.arrival_counters} arrival counters, workspace "
            f"{plan.workspace_bytes} bytes")


def main(argv: list[str] | None = None) -> None:
    """``python -m jax_w4a4.budget``: every compiled plan; with ``w4a16 M N K``, ``w4a4 M N K`` or ``act_quant ROWS
    K``, how one call of that shape is launched (planned for the GPU's SMs, or ``--num-sms``)."""
    import argparse

    from jax_w4a4 import reference
    from jax_w4a4.ops import _library

    # --num-sms before or after the subcommand; SUPPRESS keeps a subcommand without it from resetting the other's.
    sms = argparse.ArgumentParser(add_help=False)
    sms.add_argument("--num-sms", type=int, default=argparse.SUPPRESS,
                     help="SMs to plan for (default: the GPU's, else 132)")
    parser = argparse.ArgumentParser(prog="python -m jax_w4a4.budget", description=main.__doc__, parents=[sms])
    ops = parser.add_subparsers(dest="op")
    w4a16 = ops.add_parser("w4a16", parents=[sms], help="the launch plan of one w4a16 GEMM call")
    for name in ("m", "n", "k"):
        w4a16.add_argument(name, type=int)
    w4a16.add_argument("--group-size", type=int, default=128, help="32, 64, 128 or K (default 128)")
    w4a16.add_argument("--act-order", action="store_true")
    w4a4 = ops.add_parser("w4a4", parents=[sms], help="the instance of one w4a4 GEMM call")
    for name in ("m", "n", "k"):
        w4a4.add_argument(name, type=int)
    w4a4.add_argument("--act-format", choices=reference.ACT_FORMATS, default="int4")
    act = ops.add_parser("act_quant", parents=[sms], help="the launch plan of one act_quant call")
    act.add_argument("rows", type=int)
    act.add_argument("k", type=int)
    act.add_argument("--rank", type=int, default=32)
    args = parser.parse_args(argv)
    num_sms = getattr(args, "num_sms", None)
    num_sms = _library.cuda_sm_count() if num_sms is None else num_sms
    if num_sms < 1:
        parser.error(f"--num-sms must be at least 1, got {num_sms}")
    try:
        if args.op == "w4a16":
            print(describe_w4a16_launch(args.m, args.n, args.k, args.group_size, act_order=args.act_order, num_sms=num_sms))
        elif args.op == "w4a4":
            print(describe_w4a4_launch(args.m, args.n, args.k, num_sms=num_sms, act_format=args.act_format))
        elif args.op == "act_quant":
            print(describe_act_quant_launch(args.rows, args.k, args.rank, num_sms=num_sms))
        else:
            print(table(), end="")
    except ValueError as error:
        parser.error(str(error))

