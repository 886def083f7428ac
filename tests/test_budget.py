"""The compile-time shared-memory plans: every amortize-vs-replicate decision, and that the solver is tight.

Hopper rules (TMA multicast): the footprint of a multicast object is REPLICATED in every CTA of the
cluster, each CTA ISSUES only its slice, and each CTA's full barrier EXPECTS the whole tile.
"""

import functools
import itertools
import subprocess
import sys

import pytest

from jax_w4a4 import budget
from jax_w4a4.budget import Lifetime, Sharing

TOKEN_OPERANDS = ("activations", "activation scales", "LA chunk (fp32")
PRIVATE_OPERANDS = ("weights", "weight scales", "L_up chunk", "LA chunk (16-bit", "alpha, beta", "output tile")


@pytest.fixture(scope="module")
def pair():
    """The same tile without and with a cluster of two."""
    return budget.w4a4_plan(128, 64, 1), budget.w4a4_plan(128, 64, 2)


def test_token_operands_are_multicast_only_in_a_cluster(pair):
    single, clustered = pair
    for name in TOKEN_OPERANDS:
        assert single.object(name).sharing == Sharing.PRIVATE
        assert clustered.object(name).sharing == Sharing.MULTICAST
    for name in PRIVATE_OPERANDS:
        assert clustered.object(name).sharing == Sharing.PRIVATE


def test_multicast_footprint_is_replicated_not_halved(pair):
    single, clustered = pair
    for name in TOKEN_OPERANDS:
        one, two = single.object(name), clustered.object(name)
        assert two.bytes == one.bytes, name
        assert two.footprint // two.stages == one.footprint // one.stages, name


def test_multicast_issue_is_split_over_the_cluster(pair):
    single, clustered = pair
    for name in TOKEN_OPERANDS:
        assert clustered.object(name).issued_bytes * 2 == clustered.object(name).bytes, name
        assert single.object(name).issued_bytes == single.object(name).bytes, name
    for name in PRIVATE_OPERANDS:
        assert clustered.object(name).issued_bytes == clustered.object(name).bytes, name


def test_barriers_expect_the_whole_tile(pair):
    for plan in pair:
        main = [o for o in plan.objects if o.lifetime == Lifetime.MAIN_LOOP]
        assert all(o.expected_tx_bytes == o.bytes for o in plan.objects)
        assert plan.main_stage_tx_bytes == sum(o.bytes for o in main)
    single, clustered = pair
    assert clustered.main_stage_tx_bytes == single.main_stage_tx_bytes
    multicast_bytes = sum(o.bytes for o in clustered.objects if o.lifetime == Lifetime.MAIN_LOOP and o.sharing == Sharing.MULTICAST)
    assert clustered.main_stage_issued_bytes == clustered.main_stage_tx_bytes - multicast_bytes // 2


def test_low_rank_up_projection_is_not_halved_by_the_cluster(pair):
    """The seeds' bug was the opposite mistake on Blackwell; on Hopper L_up is private and whole."""
    single, clustered = pair
    assert clustered.object("L_up chunk").bytes == single.object("L_up chunk").bytes == 64 * 128 * 2
    assert clustered.object("L_up chunk").footprint == single.object("L_up chunk").footprint


def test_a_cluster_buys_no_shared_memory(pair):
    single, clustered = pair
    assert clustered.main_stages == single.main_stages
    assert clustered.total_bytes == single.total_bytes


@pytest.mark.parametrize(
    "shape",
    [(128, 8, 1, 64), (128, 16, 1, 64), (128, 32, 1, 64), (128, 64, 2, 64), (128, 128, 2, 32),
     (128, 128, 2, 32, 8, True), (128, 256, 2, 16, 8, True)],
)
def test_instantiated_plans_fit_and_are_tight(shape):
    plan = budget.w4a4_plan(*shape)
    # Two CTAs per SM for the decode tiles up to 16 tokens; each CTA allocates the plan + 1 KB of
    # alignment slack, and the driver reserves 1 KB per CTA.
    assert plan.ctas_per_sm == (2 if shape[1] <= 16 else 1)
    assert plan.smem_limit == min(budget.SMEM_PER_SM // plan.ctas_per_sm - 1024, budget.SMEM_PER_BLOCK) - 1024
    assert plan.total_bytes <= plan.smem_limit
    assert plan.main_stages >= 3
    assert plan.total_bytes == sum(o.footprint for o in plan.objects)
    if plan.main_stages < 8:  # the solver stopped because one more stage would not fit
        assert plan.total_bytes + plan.main_stage_bytes > plan.smem_limit


def test_main_stages_come_before_low_rank_stages():
    plan = budget.w4a4_plan(128, 128, 2, lora_chunk=64)
    assert plan.main_stages >= 3
    assert plan.lora_stages == 1  # two low-rank stages of 64 ranks would push the main loop under 3


@pytest.mark.parametrize(
    "shape",
    [(128, 8, 1, 64), (128, 16, 1, 64), (128, 32, 1, 64), (128, 64, 1, 64), (128, 128, 2, 32),
     (128, 128, 2, 32, 8, True), (128, 128, 2, 64), (128, 256, 2, 16, 8, True)],
)
def test_a_second_low_rank_stage_is_worth_less_than_two_main_stages(shape):
    """Recomputes both candidate plans from the solved one's bytes: one low-rank stage where it buys two more
    main stages (or where two would leave fewer than three), else two."""
    plan = budget.w4a4_plan(*shape)
    lora_stage = sum(o.footprint // o.stages for o in plan.objects if o.lifetime == Lifetime.LOW_RANK)
    fixed = plan.total_bytes - plan.main_stages * plan.main_stage_bytes - plan.lora_stages * lora_stage

    def most_main_stages(lora_stages: int) -> int:
        return min(8, (plan.smem_limit - fixed - lora_stages * lora_stage) // plan.main_stage_bytes)

    one, two = most_main_stages(1), most_main_stages(2)
    if two < 3 or one >= two + 2:
        assert (plan.main_stages, plan.lora_stages) == (one, 1)
    else:
        assert (plan.main_stages, plan.lora_stages) == (two, 2)


def test_stage_bytes_follow_the_tile():
    plan = budget.w4a4_plan(128, 32, 1)
    assert plan.object("weights").bytes == 128 * 128 // 2  # int4: half a byte per value
    assert plan.object("activations").bytes == 32 * 128  # one e4m3 code per value
    assert plan.object("weight scales").bytes == 128 * 2 * 2  # two groups of 64 per stage, 16-bit
    assert plan.object("LA chunk (fp32").bytes == 32 * 64 * 4


@pytest.mark.parametrize("tile_m,cluster", [(8, 1), (16, 1), (32, 1), (64, 2), (128, 2), (256, 2)])
def test_activation_scales_are_16_byte_records(tile_m, cluster):
    """Each token owns 16 bytes per stage: in decode tiles the stage's two 8-byte promotion records (fp32 scale,
    fp32 offset term), in prefill tiles its 4-byte scale word then zeros, so that the 16 bytes are the K-major B
    row of the scale wgmma. Each CTA holds the whole tile's records, a multicast object's footprint."""
    scales = budget.w4a4_plan(128, tile_m, cluster).object("activation scales")
    assert scales.bytes == tile_m * 16
    assert scales.footprint == scales.stages * max(scales.bytes, 128)


@pytest.mark.parametrize("m", [1, 7, 16, 20, 32])
def test_decode_workspace_holds_the_promotion_records(m):
    """Decode tiles cancel their weights' offset with each token's promotion records, m x k/64 x 8 bytes in the
    workspace after the stream-K partials (256-byte aligned); prefill tiles hold none."""
    assert budget.w4a4_workspace_bytes(m, 128, 256, num_sms=132) == m * 4 * 8  # one column tile: no stream-K
    records = m * (8192 // 64) * 8
    with_partials = budget.w4a4_workspace_bytes(m, 28672, 8192, num_sms=132)  # 224 tiles on 132 x 2 or 132 CTAs
    assert with_partials > records and (with_partials - records) % 256 == 0
    assert budget.w4a4_workspace_bytes(64, 128, 256, num_sms=132) == 0


def test_table_lists_every_instantiated_plan():
    text = budget.table()
    assert text.count("w4a4_gemm sm90:") == 7
    assert text.count("expanded weights") == 2
    assert "DOES NOT FIT" not in text


def test_expanded_weights_are_a_private_swizzled_operand_of_twice_the_bytes():
    """The long-prefill instance stages e4m3 weights (a byte per value, expanded before the GEMM) in shared
    memory with the 128-byte swizzle, for ldmatrix: 1 KB-aligned buffers, private to each CTA (the cluster
    shares tokens, not columns), so each CTA issues and its barrier expects the whole 16 KB. The bytes cost
    the 128-token tile main stages (6 with one low-rank stage -> 3 with two)."""
    prepacked = budget.w4a4_plan(128, 128, 2, 32)
    expanded = budget.w4a4_plan(128, 128, 2, 32, expanded_weights=True)
    assert prepacked.object("weights").name.startswith("weights (int4")
    weights = expanded.object("weights")
    assert weights.name.startswith("weights (e4m3")
    assert weights.bytes == 2 * prepacked.object("weights").bytes == 128 * 128
    assert weights.sharing == Sharing.PRIVATE and weights.issued_bytes == weights.expected_tx_bytes == weights.bytes
    assert weights.footprint == weights.stages * weights.bytes and weights.bytes % 1024 == 0
    assert expanded.main_stage_tx_bytes == prepacked.main_stage_tx_bytes + 128 * 128 // 2
    assert (prepacked.main_stages, prepacked.lora_stages) == (6, 1)
    assert (expanded.main_stages, expanded.lora_stages) == (3, 2)


def test_the_256_token_tile_fits_by_staging_its_output_in_halves():
    """The 256-token tile on expanded weights holds three main stages of 52.5 KB (16 KB of weights, 32 KB of
    tokens, their scales) in 227 KB because its epilogue stages 128 tokens a store (two TMA stores a tile: 32 KB,
    not 64) and its low-rank chunks are 16 ranks (LA rows of 32 bytes, the 32-byte swizzle): one low-rank stage of
    28 KB instead of 57."""
    plan = budget.w4a4_plan(128, 256, 2, 16, expanded_weights=True)
    assert (plan.main_stages, plan.lora_stages) == (3, 1)
    assert plan.main_stage_bytes == 16384 + 512 + 256 * 128 + 256 * 16
    assert plan.object("output tile staging").bytes == 128 * 128 * 2
    assert plan.object("LA chunk (16-bit").bytes == 256 * 16 * 2
    assert plan.object("activations").issued_bytes == 128 * 128  # each CTA of the pair issues 128 token rows
    assert plan.total_bytes <= plan.smem_limit < plan.total_bytes + plan.main_stage_bytes
    # With 32-rank chunks and a whole-tile staging buffer the plan would not hold three main stages.
    staging_and_lora_saved = 128 * 128 * 2 + 256 * 16 * 4 + 256 * 16 * 2 + 16 * 128 * 2
    assert plan.total_bytes + staging_and_lora_saved > plan.smem_limit


def _prefill_rounds(m: int, n: int, tile_m: int, num_sms: int) -> int:
    cluster_tiles = -(-m // tile_m) * -(-(n // 128) // 2)
    return -(-cluster_tiles // (num_sms // 2))


@pytest.mark.parametrize("num_sms", [132, 114, 8])
@pytest.mark.parametrize("act_format", ["int4", "uint4", "fp8"])
def test_long_prefills_take_the_256_token_tile_where_its_rounds_are_no_more_work(num_sms, act_format):
    """On expanded weights the launch runs the 256-token tile when its rounds of twice the work are no more work
    than the 128-token tile's rounds (clusters of 2, num_sms / 2 of them at once), else the 128-token tile, which
    fp8 activations always keep; below the expanded-weights threshold the smallest token tile that holds M."""
    first = budget.w4a4_expanded_weights_min_tokens()
    for m in (1, 8, 9, 64, 65, 128, 129, first - 1, first, first + 1, 1000, 1100, 2048, 4096, 8192):
        for n in (128, 1152, 3072, 8192, 28672):
            tile = budget.w4a4_launch_tile(m, n, num_sms=num_sms, act_format=act_format)
            assert tile.expanded_weights == (m >= first)
            if m < first:
                assert tile.tile_m == next(t for t in (8, 16, 32, 64, 128) if m <= t or t == 128)
                continue
            wide = 2 * _prefill_rounds(m, n, 256, num_sms) <= _prefill_rounds(m, n, 128, num_sms)
            assert (tile.tile_m, tile.cluster) == ((256 if wide and act_format != "fp8" else 128), 2)
    assert budget.w4a4_launch_tile(8192, 8192, num_sms=132).tile_m == 256  # 16 rounds against 32
    assert budget.w4a4_launch_tile(first, 8192, num_sms=132).tile_m == 128  # 2 rounds of 256 against 3 of 128
    with pytest.raises(ValueError, match="act_format"):
        budget.w4a4_launch_tile(8192, 8192, num_sms=132, act_format="int8")


def test_expanded_weights_serve_long_prefills_from_their_workspace():
    """From w4a4_expanded_weights_min_tokens tokens the launch expands the weights into its workspace (N x K
    bytes; the cluster tiles have no stream-K); below, the same tile converts them in registers."""
    first = budget.w4a4_expanded_weights_min_tokens()
    assert 128 < first <= 4096
    for n, k in ((8192, 8192), (28672, 8192), (128, 128)):
        assert budget.w4a4_workspace_bytes(first, n, k, num_sms=132) == n * k
        assert budget.w4a4_workspace_bytes(8192, n, k, num_sms=132) == n * k
        assert budget.w4a4_workspace_bytes(first - 1, n, k, num_sms=132) == 0


# ---- act_quant: several small CTAs per SM, the ring solved for them ----

def _act_quant_plans():
    return [budget.act_quant_plan(*shape) for shape in budget.act_quant_shapes()]


def test_act_quant_plans_add_up():
    for p in _act_quant_plans():
        chunk = 128
        assert p.x_tile_bytes == p.block_rows * chunk * 2
        assert p.lambda_bytes == chunk * 4
        assert p.lora_tile_bytes == (0 if p.rank_cap == 0 else chunk * p.lora_row_pitch)
        assert p.lora_row_pitch == p.rank_cap * 2  # TMA-swizzled slabs, no pad
        assert p.stage_bytes == p.x_tile_bytes + p.lambda_bytes + p.lora_tile_bytes
        assert p.ring_bytes == p.stages * p.stage_bytes
        assert p.column_table_bytes == 2 * 2 * chunk * 4
        assert p.barrier_bytes == p.stages * 8  # a full mbarrier per stage
        assert p.x_tile_bytes % 1024 == 0  # the X ring's tiles keep the 128-byte swizzle's 1 KB atoms
        assert p.lora_tile_bytes % 1024 == 0  # so do the L_down ring's slabs, which follow the X ring
        assert p.total_bytes == p.ring_bytes + p.column_table_bytes + p.barrier_bytes + 1024  # + base alignment
        assert p.per_sm_bytes == p.ctas_per_sm * (p.total_bytes + budget.SMEM_RESERVED_PER_CTA)


def test_act_quant_plans_fit_their_occupancy_and_are_tight():
    for p in _act_quant_plans():
        assert p.fits
        assert 2 <= p.stages <= 6
        assert p.total_bytes <= budget.SMEM_PER_BLOCK
        assert p.per_sm_bytes <= budget.SMEM_PER_SM, p
        if p.stages < 6:  # one more stage would break the designed CTAs per SM
            one_more = p.total_bytes + p.stage_bytes + 8
            more = p.ctas_per_sm * (one_more + budget.SMEM_RESERVED_PER_CTA)
            assert more > budget.SMEM_PER_SM or one_more > budget.SMEM_PER_BLOCK, p


def test_act_quant_threads_tile_the_rows():
    for p in _act_quant_plans():
        assert p.threads == 32 * p.warps
        assert p.passes * p.units_per_pass * (p.threads // 8) == p.block_rows  # 8 threads per row
        assert (p.threads // 8) % 4 == 0  # quantizer rows per step keep the X swizzle's phase (2 row + half) % 8
        assert p.max_registers == min(255, budget.REGISTERS_PER_SM // (p.threads * p.ctas_per_sm) // 8 * 8)


def test_act_quant_bandwidth_instance():
    """The large-M, rank-32 instance: 4 CTAs of 128 threads per SM, 128 registers, two stages of 16 KB of
    X each, so 4 x 16 KB of X is in flight per SM while the other stage is quantized."""
    p = budget.act_quant_plan(64, 32)
    assert (p.threads, p.ctas_per_sm, p.max_registers) == (128, 4, 128)
    assert p.stages >= 2 and p.x_tile_bytes == 16 * 1024
    assert p.ctas_per_sm * p.x_tile_bytes * (p.stages - 1) >= 32 * 1024


def test_act_quant_launch_fills_the_resident_ctas():
    """M = K = 4096 at rank 32: 64 row blocks of 64 rows split 8 ways along K = 512 CTAs, one wave of the
    132 x 4 resident ones (no cluster, so nothing halves the split); the workspace holds every split's
    fp32 LA partial; each row block has an arrival counter (outside the workspace)."""
    p = budget.act_quant_launch(4096, 4096, 32, num_sms=132)
    assert (p.block_rows, p.rank_cap, p.row_blocks, p.k_splits) == (64, 32, 64, 8)
    assert p.workspace_bytes == 64 * 8 * 64 * 32 * 4
    assert p.arrival_counters == 64
    assert p.row_blocks * p.k_splits <= 132 * budget.act_quant_plan(64, 32).ctas_per_sm
    big = budget.act_quant_launch(4096, 12288, 32, num_sms=132)
    assert (big.block_rows, big.row_blocks, big.k_splits) == (64, 64, 8)


def test_act_quant_launch_small_m_splits_k_wide():
    """Decode (M = 1, K = 8192, 64 chunks): one 16-row block split 64 ways (one chunk a CTA: the grid stays within
    one CTA per SM), partials for the whole 16-row block; ranks are bucketed; rank 0 splits K without a workspace."""
    p = budget.act_quant_launch(1, 8192, 32, num_sms=132)
    assert (p.block_rows, p.rank_cap, p.row_blocks, p.k_splits) == (16, 32, 1, 64)
    assert p.workspace_bytes == 64 * 16 * 32 * 4 and p.arrival_counters == 1
    p = budget.act_quant_launch(1, 8192, 48, num_sms=132)
    assert p.rank_cap == 128 and p.workspace_bytes == 32 * 16 * 48 * 4  # the actual rank, not the cap
    p = budget.act_quant_launch(1, 8192, 0, num_sms=132)
    assert (p.rank_cap, p.k_splits, p.workspace_bytes, p.arrival_counters) == (0, 64, 0, 0)
    # Short K splits down to one chunk a CTA; one chunk cannot be split.
    assert budget.act_quant_launch(1, 128, 32, num_sms=132).k_splits == 1
    assert budget.act_quant_launch(1, 128, 32, num_sms=132).workspace_bytes == 0
    assert budget.act_quant_launch(1, 512, 32, num_sms=132).k_splits == 4
    # Past one CTA per SM a split CTA keeps two chunks: 64 rows (4 row blocks) at K = 8192 split 32 ways, not 64.
    assert budget.act_quant_launch(64, 8192, 32, num_sms=132).k_splits == 32
    # At most 64 splits: K = 28672 (224 chunks) in 64.
    assert budget.act_quant_launch(16, 28672, 32, num_sms=132).k_splits == 64
    # Enough rows fill the GPU without a split.
    p = budget.act_quant_launch(64 * 600, 4096, 32, num_sms=132)
    assert (p.block_rows, p.k_splits, p.workspace_bytes) == (64, 1, 0)


def test_act_quant_idle_sm_split_weighs_the_sum_rounds():
    """The split on idle SMs doubles only while the chunks it takes off a CTA cost more than the rounds of loads
    it adds to the last CTA's sum (act_quant_plan.h, costs fitted in session 43). Ranks up to 32 at decode sum 64
    splits in one or two rounds, so they double down to one chunk a CTA; above 32 a thread adds several LA quads
    (no lane groups) and each doubling doubles the rounds, which pays only where it takes several chunks off a CTA
    (session 43, us: 16 x 8192 at rank 128, 32 -> 64 splits, 8.0 -> 9.5; 1 x 28672 at rank 128, 11.9 -> 11.2;
    16 x 3072 at rank 64, 8 -> 16 splits with the sum still one round, 7.3 -> 6.5)."""
    def splits(rows, k, rank):
        return budget.act_quant_launch(rows, k, rank, num_sms=132).k_splits

    assert splits(1, 8192, 32) == 64 and splits(16, 8192, 32) == 64 and splits(16, 28672, 32) == 64
    assert splits(1, 8192, 0) == 64 and splits(1, 28672, 0) == 64  # no partials: nothing to weigh
    assert splits(16, 8192, 128) == 32 and splits(16, 14336, 128) == 32
    assert splits(1, 28672, 128) == 64 and splits(16, 28672, 128) == 64
    assert splits(1, 4096, 256) == 16 and splits(1, 8192, 64) == 32
    assert splits(16, 3072, 64) == 16 and splits(7, 3072, 128) == 16


def test_act_quant_launch_stays_in_one_wave():
    """From 1024 rows the launch takes 64-row blocks; a split whose doubling would overshoot the resident CTAs is
    cut back to one wave, to any count (512 rows: 32 row blocks of 16 x 12 splits on 132 x 3 resident CTAs).
    Session 41 measured both against 1.3 waves of 16-row blocks (2048 x 3072: 23.1 -> 13.0 us)."""
    p = budget.act_quant_launch(2048, 3072, 32, num_sms=132)
    assert (p.block_rows, p.row_blocks, p.k_splits) == (64, 32, 8)
    p = budget.act_quant_launch(512, 4096, 32, num_sms=132)
    assert (p.block_rows, p.row_blocks, p.k_splits) == (16, 32, 12)
    assert p.workspace_bytes == 32 * 12 * 16 * 32 * 4 and p.arrival_counters == 32
    assert budget.act_quant_launch(960, 4096, 32, num_sms=132).block_rows == 16
    assert budget.act_quant_launch(1024, 4096, 32, num_sms=132).block_rows == 64
    for num_sms in (8, 114, 132):
        for rows in (1, 64, 333, 512, 1000, 1024, 2048, 3072, 4096, 8192):
            for k in (1024, 3072, 4096, 12288):
                for rank in (0, 32, 128):
                    p = budget.act_quant_launch(rows, k, rank, num_sms=num_sms)
                    resident = num_sms * budget.act_quant_plan(p.block_rows, p.rank_cap).ctas_per_sm
                    assert p.k_splits == 1 or p.row_blocks * p.k_splits <= resident
                    # Two chunks a split CTA at least, or one where the grid keeps to one CTA per SM.
                    assert p.k_splits == 1 or k // 128 >= 2 * p.k_splits or (
                        k // 128 >= p.k_splits and p.row_blocks * p.k_splits <= num_sms)


def test_act_quant_launch_counters_fit_the_pool():
    """A split uses one arrival counter per row block; at every SM count the handlers accept they fit the
    pool (the plan header static_asserts the bound; this checks the plans themselves)."""
    limits = budget.arrival_counter_limits()
    for num_sms in (1, 132, limits.max_num_sms):
        for rows, k, rank in [(1, 4096, 16), (33, 1536, 16), (333, 3072, 128), (4096, 576 * 2, 256), (8192, 8192, 32)]:
            p = budget.act_quant_launch(rows, k, rank, num_sms=num_sms)
            split = p.k_splits > 1
            assert p.workspace_bytes == (p.row_blocks * p.k_splits * p.block_rows * rank * 4 if split else 0)
            assert p.arrival_counters == (p.row_blocks if split else 0)
            assert p.arrival_counters <= limits.counters


def test_w4a16_split_k_counts_one_arrival_counter_per_tile_and_row_warp():
    """For each row warp, the last of its splits to arrive sums that warp's rows: a split-K launch uses one counter
    per token block, column tile and row warp of its form (the CTA's launch bound: 16 for one-token whole-SM CTAs,
    else 8); unsplit and narrow launches none. At every SM count the handlers accept they fit the pool."""
    limits = budget.arrival_counter_limits()
    assert limits.counters == 8192
    plan = functools.partial(budget.w4a16_launch, group_size=128, act_order=False, num_sms=132)
    whole1 = plan(1, 28672, 8192)  # 32 tiles of 14 row warps, launched as 16
    assert (whole1.form, whole1.n_tiles, whole1.splits, whole1.arrival_counters) == ("whole", 32, 4, 32 * 16)
    whole7 = plan(16, 28672, 8192)
    assert (whole7.form, whole7.n_tiles, whole7.splits, whole7.arrival_counters) == ("whole7", 32, 4, 32 * 8)
    wide = plan(64, 4096, 4096)  # one token block, 32 column tiles of 4 row warps: counters by the launch bound, 8
    assert (wide.form, wide.m_blocks, wide.n_tiles, wide.warps, wide.arrival_counters) == ("wide", 1, 32, 4, 32 * 8)
    blocks = plan(200, 4096, 4096)  # 4 token blocks x 16 column tiles
    assert (blocks.m_blocks, blocks.n_tiles, blocks.arrival_counters) == (4, 16, 4 * 16 * 8)
    assert plan(1, 8192, 8192).arrival_counters == 0  # narrow, unsplit
    assert plan(1, 1024, 4096).arrival_counters == 0  # a narrow K-split cluster adds in shared memory
    for num_sms in (1, 8, 132, limits.max_num_sms):
        for m, n, k in [(1, 28672, 8192), (16, 28672, 8192), (32, 8192, 28672), (64, 4096, 4096), (200, 11008, 4096),
                        (1, 152064, 8192), (16, 32, 152064), (9, 4096, 14336)]:
            p = budget.w4a16_launch(m, n, k, 128, act_order=False, num_sms=num_sms)
            split = p.splits > 1 and not p.narrow
            assert p.arrival_counters == (p.m_blocks * p.n_tiles * budget.w4a16_plan(p.m_tiles, form=p.form).max_warps
                                          if split else 0)
            assert p.arrival_counters <= limits.counters


def test_table_lists_act_quant_plans():
    text = budget.table()
    assert text.count("act_quant sm90:") == len(budget.act_quant_shapes()) == 8


# ---- w4a16: two CTAs per SM up to 16 tokens, the ring solved for the designed occupancy; narrow CTAs ----

def _check_w4a16_plan(p, max_stages):
    assert p.block_m == 8 * p.m_tiles
    assert p.stage_weight_bytes == p.stage_atoms * p.block_rows * 64 // 2  # 64-wide atoms of every row, int4
    assert p.stage_x_bytes == p.stage_atoms * p.block_m * 128  # one 128-byte swizzled row per token and atom
    # two 32-wide groups an atom: 16-bit scales, uint8 zeros
    assert p.stage_scale_bytes == p.stage_atoms * 2 * p.block_rows * (2 + 1)
    assert p.stage_bytes == p.stage_weight_bytes + p.stage_x_bytes + p.stage_scale_bytes
    assert p.ring_bytes == p.stages * p.stage_bytes
    assert p.barrier_bytes == p.stages * 2 * 8  # a full and an empty mbarrier per stage
    # narrow: the slots of 3 other CTAs of a K-split cluster (a warp's fp32 accumulators: 32 lanes x tiles x
    # 4 x m_tiles) and their mbarrier, padded to 16 bytes
    warp_sums = 32 * p.tiles_per_warp * 4 * p.m_tiles * 4
    assert p.cluster_sum_bytes == (3 * warp_sums + 16 if p.form in ("narrow", "narrow32") else 0)
    # narrow: the k-lanes past the first (every launched warp but lane 0 and the producer) hand k-lane 0 their
    # accumulators through the ring's bytes
    assert p.lane_sum_bytes == ((p.max_warps - 2) * warp_sums if p.form in ("narrow", "narrow32") else 0)
    assert p.lane_sum_bytes <= p.ring_bytes
    # + slack to align the swizzle atoms
    assert p.total_bytes == p.ring_bytes + p.barrier_bytes + p.cluster_sum_bytes + 1024
    assert p.per_sm_bytes == p.ctas_per_sm * (p.total_bytes + budget.SMEM_RESERVED_PER_CTA)
    assert p.fits and 4 <= p.stages <= max_stages
    assert p.total_bytes <= budget.SMEM_PER_BLOCK and p.per_sm_bytes <= budget.SMEM_PER_SM
    if p.stages < max_stages:  # one more stage would break the designed CTAs per SM
        one_more = p.total_bytes + p.stage_bytes + 2 * 8
        assert p.ctas_per_sm * (one_more + budget.SMEM_RESERVED_PER_CTA) > budget.SMEM_PER_SM


def test_w4a16_plans_add_up_fit_and_are_tight():
    plans = [budget.w4a16_plan(m) for m in budget.w4a16_m_tiles()]
    assert [p.m_tiles for p in plans] == [1, 2, 4, 8]
    # Up to 16 tokens (mma.sync) a warp owns 4 m16 tiles, past that (wgmma) 2: their accumulators and partials
    # fill the registers.
    assert [p.tiles_per_warp for p in plans] == [4, 4, 2, 2]
    for p in plans:
        assert p.form == "wide" and p.stage_atoms == 1 and p.max_warps == 8
        assert p.block_rows == 8 * p.tiles_per_warp * 16
        _check_w4a16_plan(p, max_stages=16)
    assert [p.ctas_per_sm for p in plans] == [2, 2, 1, 1]


def test_w4a16_narrow_plans_add_up_fit_and_are_tight():
    """Narrow CTAs (8 and 16 tokens): one per SM, one warp's 64 rows (narrow32: 32), stages of 4 atoms (8 KB of
    weights, narrow32 4 KB: one TMA box), up to 8 k-lanes (12 at the 16-token narrow tile) and a producer warp;
    the K-split cluster's sums fit beside the ring without costing it a stage (the stage counts are those from
    before the clusters)."""
    for form, tiles, stages in (("narrow", 4, [16, 12]), ("narrow32", 2, [25, 17])):
        for m_tiles in (1, 2):
            p = budget.w4a16_plan(m_tiles, form=form)
            lanes = 12 if (form, m_tiles) == ("narrow", 2) else 8
            assert p.form == form and p.ctas_per_sm == 1 and p.stage_atoms == 4 and p.max_warps == lanes + 1
            assert p.tiles_per_warp == tiles and p.block_rows == tiles * 16 and p.stage_weight_bytes == tiles * 2048
            _check_w4a16_plan(p, max_stages=32)
        assert [budget.w4a16_plan(m, form=form).stages for m in (1, 2)] == stages


def test_w4a16_whole_sm_plan_adds_up_fits_and_is_tight():
    """Whole-SM CTAs: one CTA per SM, its ring of 1-atom stages as deep as the SM's shared memory allows. At the
    one-token tile the warps of a wide pair (16) with 4 m16 tiles each, the same per SM as two wide CTAs; at the
    16- and 32-token tiles 8 warps, twice the wide CTA's tiles a warp (so fewer, larger stages); "whole7" at the
    16-token tile 8 warps of 7 tiles (896 rows: 7 warps' worth of "whole" tiles)."""
    p = budget.w4a16_plan(1, form="whole")
    assert p.form == "whole" and p.ctas_per_sm == 1 and p.max_warps == 16 and p.stage_atoms == 1
    assert p.block_rows == 16 * 4 * 16 and p.stage_weight_bytes == 2 * budget.w4a16_plan(1).stage_weight_bytes
    _check_w4a16_plan(p, max_stages=16)
    assert p.stages == budget.w4a16_plan(1).stages == 5
    p32, wide32 = budget.w4a16_plan(4, form="whole"), budget.w4a16_plan(4)
    assert p32.ctas_per_sm == wide32.ctas_per_sm == 1 and p32.max_warps == wide32.max_warps == 8
    assert (p32.tiles_per_warp, wide32.tiles_per_warp) == (4, 2) and p32.block_rows == 8 * 4 * 16
    assert p32.stage_weight_bytes == 2 * wide32.stage_weight_bytes and p32.stage_x_bytes == wide32.stage_x_bytes
    _check_w4a16_plan(p32, max_stages=16)
    assert (p32.stages, wide32.stages) == (9, 16)
    p16, wide16 = budget.w4a16_plan(2, form="whole"), budget.w4a16_plan(2)
    assert (p16.ctas_per_sm, wide16.ctas_per_sm) == (1, 2) and p16.max_warps == wide16.max_warps == 8
    assert (p16.tiles_per_warp, wide16.tiles_per_warp) == (8, 4) and p16.block_rows == 8 * 8 * 16
    assert p16.stage_weight_bytes == 2 * wide16.stage_weight_bytes and p16.stage_x_bytes == wide16.stage_x_bytes
    _check_w4a16_plan(p16, max_stages=16)
    assert (p16.stages, p16.total_bytes) == (5, 205904)
    p7 = budget.w4a16_plan(2, form="whole7")
    assert p7.ctas_per_sm == 1 and p7.max_warps == 8 and (p7.tiles_per_warp, p7.block_rows) == (7, 8 * 7 * 16)
    assert 8 * p7.stage_weight_bytes == 7 * p16.stage_weight_bytes and p7.stage_x_bytes == p16.stage_x_bytes
    _check_w4a16_plan(p7, max_stages=16)
    assert (p7.stages, p7.total_bytes) == (6, 217696)  # 7/8 of the weights: a sixth stage fits
    with pytest.raises(ValueError, match="form must be one of"):
        budget.w4a16_plan(1, form="paired")


def test_table_lists_w4a16_plans():
    assert budget.table().count("w4a16_gemm sm90:") == 4 + 3 + 1 + 2 + 2
    assert budget.table().count("w4a16_gemm sm90:") - budget.table().count(", wide,") == 8
    assert budget.table().count(", narrow32 (") == 2
    assert budget.table().count(", whole-SM ") == 3
    assert budget.table().count(", whole7 (") == 1


def test_w4a16_narrow_ctas_serve_small_layers():
    """Narrow CTAs own one warp's rows and all of K: no split-K partials. Narrow32 CTAs (32 rows) wherever N / 32
    of them fit one wave, K has at most 128 atoms and each streams no more rows x columns than a CTA of the
    wide plan (w4a16_gemm_plan.h: kNarrow32TilesPerWarp). Otherwise 64-row narrow CTAs where one wave of them
    fits and the planner's model (NarrowGainUs) says they beat the wide plan (the next test). Narrow CTAs run a
    k-lane per 4-atom stage up to 8 (12 at the 16-token narrow tile; with runs of one atom four share a stage) and
    two of the ring's runs each; every launch past 16 tokens runs wide."""
    plan = functools.partial(budget.w4a16_launch, group_size=64, act_order=False, num_sms=132)
    small = plan(1, 576, 1536)
    assert (small.form, small.n_tiles, small.splits, small.warps, small.k_lanes, small.threads) == ("narrow32", 18, 1, 1, 6, 7 * 32)
    assert plan(16, 1536, 576) == budget.W4a16Launch(2, 1, 1, 48, 1, "narrow32", 3, 1, 1, 4 * 32, 0)  # 9 atoms: 3 stages
    assert plan(1, 1024, 1024).k_lanes == 4 and plan(1, 384, 4096) is not None
    # 4096 rows: 128 narrow32 CTAs; 8192 rows: 256 do not fit one wave, 128 narrow ones do; 8512 rows: 133 do not.
    assert [plan(1, n, 1024).form for n in (4096, 8192, 8512)] == ["narrow32", "narrow", "wide"]
    one_wave = functools.partial(budget.w4a16_launch, 1, 1024, 1024, 64, act_order=False)  # 32 / 16 row tiles
    assert one_wave(num_sms=32).form == "narrow32" and one_wave(num_sms=31).form == "narrow"
    assert one_wave(num_sms=16).narrow and not one_wave(num_sms=15).narrow
    assert not plan(17, 576, 1536).narrow and plan(17, 576, 1536).m_tiles == 4
    benchmark_shapes = ((28672, 8192), (8192, 28672), (8192, 8192), (4096, 4096))
    assert [[plan(m, n, k).form for m in (1, 2, 4, 8, 16)] for n, k in benchmark_shapes] == [
        ["whole"] * 4 + ["whole7"],  # 448 narrow row tiles: more than one wave
        ["narrow"] * 3 + ["whole", "narrow"],  # kNarrowOverWholeMaxTokens; at 16 no whole plan fits (16 splits)
        ["narrow"] * 5,
        ["narrow32"] * 5,
    ]
    # k-lanes take runs of 1 atom when K <= 8192 (four lanes per stage: a shorter last stage), else whole stages;
    # two token tiles at any K
    assert [plan(1, 8192, k).lane_atoms for k in (8192, 8256, 28672)] == [1, 4, 4]
    assert [plan(16, 8192, k).lane_atoms for k in (8192, 8256, 28672)] == [1, 1, 1]
    assert plan(1, 576, 1536).narrow and plan(1, 576, 1536).lane_atoms == 1
    assert not plan(1, 28672, 8192).narrow and plan(1, 28672, 8192).lane_atoms == 1  # wide: 1
    # Narrow32 (short K only) and two token tiles take runs of 1 atom: the kernel has no whole-stage-run instance
    # of them.
    shapes = itertools.product((1, 8, 9, 16), (32, 512, 1536, 4096, 8192, 8448), (512, 4096, 8192, 8256, 14336, 28672))
    for m, n, k in shapes:
        p = plan(m, n, k)
        if p.narrow and (p.form == "narrow32" or p.m_tiles == 2):
            assert p.lane_atoms == 1, (m, n, k, p)
    for m, n, k in ((1, 576, 1536), (16, 1536, 576)):  # no split-K partials; the act-order gather stays
        assert budget.w4a16_workspace_bytes(m, n, k, 64, act_order=False, num_sms=132) == 0
        assert budget.w4a16_workspace_bytes(m, n, k, 64, act_order=True, num_sms=132) == 256 * -(-2 * m * k // 256)
    assert plan(0, 576, 1536) is None


def test_w4a16_narrow32_ctas_stream_no_more_than_a_wide_cta():
    """Narrow32 CTAs (32 rows, all of K) replace a wide launch where N / 32 of them fit one wave, K has at most
    128 atoms and each streams no more rows x columns than a CTA of the wide plan: there the wide CTAs (at
    least 256 rows, at most 8 splits) stream as much each and pay the split-K round trips (session 26)."""
    def launch(m, n, k, num_sms=132):
        p = budget.w4a16_launch(m, n, k, 128, act_order=False, num_sms=num_sms)
        return p.form, p.n_tiles, p.splits, p.k_lanes, p.lane_atoms

    assert launch(1, 4096, 4096) == ("narrow32", 128, 1, 8, 1)
    assert launch(16, 4096, 8192) == ("narrow32", 128, 1, 8, 1)  # wide: 16 tiles of 256 rows in 8 splits of 16 atoms
    assert launch(1, 4224, 4096)[:2] == ("narrow32", 132) and launch(1, 4256, 4096)[0] == "narrow"  # one wave
    # An H100 PCIe: 128 narrow32 CTAs do not fit one wave; 64 narrow ones stream as much as the busiest SM of
    # the wide plan (128 CTAs, two on 14 SMs).
    assert launch(1, 4096, 4096, num_sms=114)[0] == "narrow"
    assert launch(1, 4096, 8320)[:3] == ("narrow", 64, 2)  # 130 atoms: too long for narrow32; 64-row clusters of 2
    # Narrow32 CTAs of 224 atoms (measured: lost to the wide plan's CTAs of 256 rows x 16 atoms); 64-row narrow
    # CTAs in clusters of 2 stream 112 atoms each instead (test_w4a16_narrow_k_split_clusters).
    assert launch(1, 4096, 14336)[:3] == ("narrow", 64, 2)
    # One wide tile of 128 rows in 8 splits of 16 atoms; narrow32 clusters of 4 give a CTA 32 rows x 32 atoms.
    assert launch(1, 128, 8192)[:3] == ("narrow32", 4, 4)
    assert launch(1, 256, 8192)[:2] == ("narrow32", 8)  # 256 rows in 8 splits: as many bytes a CTA


def test_w4a16_narrow_ctas_beat_a_wide_plan_whose_busiest_sm_streams_as_much():
    """64-row narrow CTAs replace a wide plan where one wave of them fits and the model (NarrowGainUs) says
    they save time: the wide plan's busiest SM streams about as many weight bytes and pays its splits
    (w4a16_gemm_plan.h). Every line below was measured on the H200 (session 27, benchmarks/NOTES.md)."""
    def forms(n, k, tokens=(1, 4, 8, 16), num_sms=132):
        return [budget.w4a16_launch(m, n, k, 128, act_order=False, num_sms=num_sms).form for m in tokens]

    # The same bytes on the busiest SM as a wide pair in 8 splits: narrow won 0.3-1.3 us at 1-8 tokens, 0.45-1.5
    # at 16.
    for n, k in ((6144, 4096), (8192, 2048), (7168, 4096), (5120, 4096), (8192, 1024)):
        assert forms(n, k) == ["narrow"] * 4
    # Two token tiles with 12 k-lanes (session 38, 16 x 5120 x 8192 17.8 -> 14.8 us, 16 x 8192² 18.2 -> 17.3; with 6
    # lanes they had lost up to 2.2 us from K = 6144), at any K once their CTAs start K in phases (session 40, 16 x
    # 8192 x 14336 27.6 -> 23.8 us, 16 x 8192 x 28672 45.8 -> 43.5).
    for n, k in ((5120, 8192), (7168, 8192), (8192, 6144), (8192, 12288), (8448, 16384)):
        assert forms(n, k) == ["narrow"] * 4
    assert budget.w4a16_launch(16, 8192, 28672, 128, act_order=False, num_sms=132).k_phases == 8
    # A narrow CTA streaming 1.33-1.56x the busiest wide SM's bytes lost 1.0-3.1 us.
    assert forms(6144, 12288) == forms(5120, 14336) == forms(6144, 14336) == ["wide"] * 4
    # Against whole-SM CTAs only up to kNarrowOverWholeMaxTokens (8 x 8192 x 28672: whole 35.7 us, narrow 36.9).
    assert forms(8192, 28672, tokens=(4, 5, 8)) == ["narrow", "whole", "whole"]
    # One wave or nothing: 8512 rows are 133 narrow CTAs; an H100 PCIe (114 SMs) fits 7168 rows, not 8192.
    assert forms(8512, 4096) == ["wide"] * 4
    assert forms(7168, 4096, num_sms=114) == ["narrow"] * 4 and forms(8192, 4096, num_sms=114) == ["wide"] * 4


def test_w4a16_narrow_k_phases():
    """Unsplit narrow launches from 8 tokens whose CTAs hold all but an eighth of the SMs start K at 8 evenly spaced
    stages (NarrowKPhases), so that their CTAs do not read the same activations from L2 at once. Measured on the
    H200 with every narrow launch in 8 phases (session 39, benchmarks/NOTES.md), us at M = 8 / 16: 8192² 14.9 / 17.4
    -> 13.3 / 15.3, 4096² (narrow32) 7.17 / 8.43 -> 6.60 / 7.57, 8192 x 4096 8.95 / 10.8 -> 8.40 / 10.0."""
    def launch(m, n, k, num_sms=132):
        p = budget.w4a16_launch(m, n, k, 64, act_order=False, num_sms=num_sms)
        return p.form, p.n_tiles, p.splits, p.k_phases

    assert [launch(m, 8192, 8192)[3] for m in (1, 7, 8, 9, 16)] == [1, 1, 8, 8, 8]
    assert launch(16, 4096, 4096) == ("narrow32", 128, 1, 8) and launch(8, 8192, 4096)[3] == 8
    # 80 CTAs (5120 x 8192 lost 2.6% at 8 tokens) and K-split clusters (1536 x 28672 lost 2-4%): one order
    assert launch(8, 5120, 8192) == ("narrow", 80, 1, 1) and launch(16, 1536, 28672) == ("narrow", 24, 4, 1)
    assert launch(16, 7424, 8192) == ("narrow", 116, 1, 8) and launch(16, 7360, 8192) == ("narrow", 115, 1, 1)
    assert launch(16, 7424, 8192, num_sms=114)[3] == 1  # not a narrow launch there
    # K in whole stages of 4 atoms, at least one a phase (runs of whole stages too)
    assert [launch(16, 8192, k)[3] for k in (1792, 2048)] == [1, 8]
    assert [launch(8, 8192, k)[3] for k in (8256, 8448)] == [1, 8]
    # Wide and whole-SM launches: one order
    assert launch(8, 28672, 8192)[::3] == ("whole", 1) and launch(16, 28672, 8192)[3] == 1
    # What the launcher checks (else cudaErrorInvalidConfiguration): a power of two, unsplit narrow, whole stages
    for m, n, k in itertools.product((1, 8, 12, 16), (4096, 7424, 8192, 8448), (1024, 2048, 3136, 8192, 8256, 28672)):
        p = budget.w4a16_launch(m, n, k, 64, act_order=False, num_sms=132)
        assert p.k_phases in (1, 8), (m, n, k, p)
        if p.k_phases > 1:
            assert p.narrow and p.splits == 1 and (k // 64) % 4 == 0 and k // 256 >= p.k_phases, (m, n, k, p)


def test_w4a16_narrow_k_split_clusters():
    """Where fewer narrow CTAs than SMs own all the rows, each row tile's K is split over a cluster of 2 or 4
    CTAs that add through shared memory: the largest cluster whose CTAs fit one wave (clusters of 4 hold 120
    of the H200's 132 SMs) and keep at least 16 atoms each. No workspace. Measured on the H200 (session 28,
    benchmarks/NOTES.md), us at M = 1 / 16."""
    def launch(m, n, k, num_sms=132, group_size=128):
        p = budget.w4a16_launch(m, n, k, group_size, act_order=False, num_sms=num_sms)
        return p.form, p.n_tiles, p.splits

    def workspace(m, n, k):
        return budget.w4a16_workspace_bytes(m, n, k, 128, act_order=False, num_sms=132)

    # Unsplit narrow32 (32 CTAs) -> clusters of 2: 1024 x 4096 6.4 / 7.0 -> 5.3 / 5.9, 2048 x 8192 9.8 / 11.4 ->
    # 7.2 / 8.7, 1536 x 8192 9.8 / 11.2 -> 7.1 / 8.0. 32 clusters of 4 would need a second wave (7.9 / 8.6 us).
    for m in (1, 16):
        assert launch(m, 1024, 4096) == ("narrow32", 32, 2) and workspace(m, 1024, 4096) == 0
        assert launch(m, 2048, 8192) == ("narrow32", 64, 2) and launch(m, 1536, 8192) == ("narrow32", 48, 2)
        # 16 clusters of 4: 512 x 4096 6.1 / 6.8 (unsplit) -> 5.1 / 5.4 (2) -> 4.3 / 4.7 (4).
        assert launch(m, 512, 4096) == ("narrow32", 16, 4)
        # Wide -> narrow32 clusters of 2: 1024 x 14336 11.8 / 15.2 -> 9.8 / 10.8.
        assert launch(m, 1024, 14336) == ("narrow32", 32, 2)
    # Wide -> 64-row narrow clusters of 2: 4096 x 14336 15.0 / 19.7 -> 12.3 / 17.7, 3072 x 14336 14.8 / 19.5 -> 12.0 /
    # 17.1, 4096 x 11008 19.7 -> 15.0 at 16 tokens; 4096 x 28672 22.6 -> 20.0 at one token, and 28.9 -> 24.8 at 16
    # (224 atoms a CTA, session 40; with 128 atoms at most it was wide).
    for n, k in ((4096, 14336), (3072, 14336), (4096, 11008), (4096, 28672), (3584, 18944)):
        for m in (1, 16):
            assert launch(m, n, k) == ("narrow", n // 64, 2) and workspace(m, n, k) == 0
    # Clusters of 4 of 64-row CTAs, 112 atoms each: 1024 / 1536 x 28672 13.1 / 15.8 -> 11.9 / 12.2 at one token,
    # 17.7 / 22.5 -> 17.0 / 17.2 at 16.
    for m in (1, 16):
        assert launch(m, 1024, 28672) == ("narrow", 16, 4) and launch(m, 1536, 28672) == ("narrow", 24, 4)
    # At least 16 atoms a CTA: 1024² (8 a CTA in clusters of 2) lost 0.2-0.3 us, 576 x 1536 (12) did not gain.
    assert launch(1, 1024, 1024) == ("narrow32", 32, 1) and launch(16, 576, 1536) == ("narrow32", 18, 1)
    assert launch(1, 1024, 2048) == ("narrow32", 32, 2)
    # Per-channel scales split like any group; the other SM counts scale the cluster slots (an H100 PCIe).
    assert launch(1, 1024, 4096, group_size=4096) == ("narrow32", 32, 2)
    assert launch(1, 512, 4096, num_sms=114) == ("narrow32", 16, 4) and launch(1, 1024, 4096, num_sms=114)[2] == 2


def test_w4a16_wide_plan_counts_idle_warps_and_the_reduction():
    """Up to 16 tokens a wide CTA launches whole warpgroups and its warps without rows run the loop, so the
    planner counts launched warps; a split's reduction (the last CTA reads every split's partials, a round
    of loads per split) costs kReductionPercent of a streamed warp-atom per split and warp. Each line below
    was measured faster than the plan of the model without these terms (session 18)."""
    def grid(m, n, k):  # (warps, column tiles, splits) of the wide launch
        p = budget.w4a16_launch(m, n, k, 128, act_order=False, num_sms=132)
        return p.warps, p.n_tiles, p.splits

    # Measured here too and now narrow: 1 and 16 x 4096 x 28672 (wide 6 (8) x 11 x 24 -> 4 x 16 x 16 at 16 tokens:
    # 34.5 -> 29.2 us), now narrow clusters (test_w4a16_narrow_k_split_clusters); 16 x 8192 x 14336 (6 (8) x 22 x 12 ->
    # 4 x 32 x 8: 32.0 -> 28.1 us), now narrow CTAs (test_w4a16_narrow_ctas_beat_a_wide_plan_whose_busiest_sm_...).
    shapes = ((1, 6144, 12288), (1, 16384, 3072), (1, 11008, 11008))
    cells = {shape: grid(*shape) for shape in shapes}
    assert cells == {
        (1, 6144, 12288): (4, 24, 11),   # was 5 warps (launched as 8) x 20 tiles x 12 splits: 21.1 -> 16.3 us
        (1, 16384, 3072): (4, 64, 4),    # was 6 (8) x 43 x 6; 8 x 32 x 8 at 40 %: 12.8-13.0 -> 11.7 us
        (1, 11008, 11008): (4, 43, 6),   # was 6 (8) x 29 x 9; 7 (8) x 25 x 10 at 40 %: 24.3-24.4 -> 22.8-22.9 us
    }
    # An idle warp still wins a tie on CTAs: 8 x 28672 x 4096 takes 256 CTAs of 7 warps, as 28672 x 8192 did
    # before whole-SM CTAs (224 of 8 took 37.4-37.7 -> 38.4-39.0 us at one token).
    assert grid(8, 28672, 4096) == (7, 64, 4)


def test_w4a16_whole_sm_ctas_take_long_splits_at_one_token_tile():
    """Up to 8 tokens a layer whose splits stream at least 32 atoms, on a grid that leaves at most 1/16 of
    the SMs idle, runs one CTA per SM of up to 16 row warps instead of a wide pair (w4a16_gemm_plan.h:
    kWholeMinAtomsPerSplit, measured in session 25); shorter splits, more tokens and narrow layers do not."""
    def launch(m, n, k, num_sms=132):
        p = budget.w4a16_launch(m, n, k, 128, act_order=False, num_sms=num_sms)
        return p.form, p.warps, p.n_tiles, p.splits

    assert launch(1, 28672, 8192) == ("whole", 14, 32, 4)  # 128 CTAs of 896 rows, splits of 32 atoms
    assert launch(8, 28672, 8192) == ("whole", 14, 32, 4)
    assert launch(1, 16384, 12288) == ("whole", 12, 22, 6)  # 132 CTAs
    assert launch(1, 14336, 4096)[0] == "wide"  # 8 splits of 8 atoms (measured: a loss)
    assert launch(1, 8192, 28672)[0] == "narrow"
    assert launch(4, 8192, 8192)[0] == "narrow"  # one wave of narrow CTAs, as many bytes as a wide pair
    assert launch(1, 28672, 8192, num_sms=114) == ("whole", 12, 38, 3)  # an H100 PCIe: 114 CTAs
    # The idle-SM bound: 18432 rows make 32 tiles of 9 warps in 4 splits, 128 CTAs.
    assert launch(1, 18432, 8192) == ("whole", 9, 32, 4)
    assert launch(1, 18432, 8192, num_sms=140)[0] == "wide"  # 32 tiles x 4 splits leave 12 of 140 SMs idle
    # One wave: a vocabulary projection gets the warps whose row tiles fit the SMs (not 223 CTAs of 9 warps).
    assert launch(1, 128256, 4096) == ("whole", 16, 126, 1)


def test_w4a16_whole_sm_ctas_take_long_splits_at_the_32_token_tile():
    """17-32 tokens: the same rule picks one CTA per SM of up to 8 warps with 4 m16 tiles each (wgmma) instead
    of the wide CTA's 2 tiles a warp (session 29: 32 x 28672 x 8192 74.3 -> 61.3 us); short splits stay wide
    (8192², 4096 x 14336 and 11008 x 4096 lost with 4 tiles a warp), as do more than 8 splits and 64 tokens (no
    whole form there); a CTA gets 7 or 8 row warps (its two warpgroups launch 8)."""
    def launch(m, n, k):
        p = budget.w4a16_launch(m, n, k, 128, act_order=False, num_sms=132)
        return p.form, p.warps, p.n_tiles, p.splits

    assert launch(32, 28672, 8192) == launch(17, 28672, 8192) == ("whole", 7, 64, 2)  # 128 CTAs of 448 rows
    assert launch(32, 8192, 28672) == ("whole", 8, 16, 8)  # 128 CTAs, splits of 56 atoms
    assert launch(32, 16384, 12288) == ("whole", 8, 32, 4)  # not 6 warps in 132 CTAs: 2 idle warps of 8 lost
    for n, k in ((8192, 8192), (4096, 14336), (11008, 4096), (4096, 4096)):
        assert launch(32, n, k)[0] == "wide"
    assert launch(32, 4096, 28672)[0] == "wide"  # 13 splits of 35 atoms lost (kWholeMaxSplits)
    assert launch(33, 28672, 8192)[0] == "wide"


def test_w4a16_whole_sm_ctas_take_long_splits_at_the_16_token_tile():
    """9-16 tokens: the same rule picks one CTA per SM of 8 warps, with 8 m16 tiles each or 7 ("whole7"), instead of
    a wide pair with 4 tiles a warp (session 30: 16 x 28672 x 8192 46.5 -> 44.2 us); more than 8 splits (8192 x
    28672 in 13 lost, 46.6 -> 50.1 us; it now runs narrow CTAs) and short splits stay wide: under 32 atoms, or under
    16 for "whole7" CTAs, which have a producer warpgroup (session 52: 16 x 27648 x 5120 in splits of 20 atoms
    30.9-31.1 -> 28.4-28.6 us; "whole" in splits of 16 atoms and the one-token tile lost). 896-row CTAs are 8 warps
    of 7 tiles, not 7 of 8 with a launched warp without rows (session 31: 43.6-43.9 -> 41.7-41.9 us); where both
    forms give as many CTAs, the one with the fewer tiles x atoms a warp."""
    def launch(m, n, k):
        p = budget.w4a16_launch(m, n, k, 128, act_order=False, num_sms=132)
        return p.form, p.warps, p.n_tiles, p.splits

    assert launch(16, 28672, 8192) == launch(9, 28672, 8192) == ("whole7", 8, 32, 4)  # 128 CTAs of 896 rows
    assert launch(16, 57344, 8192) == ("whole7", 8, 64, 2)
    assert launch(16, 14336, 16384) == ("whole7", 8, 16, 8)  # "whole": 112 CTAs of 1024 rows
    assert launch(16, 28640, 8192) == ("whole7", 8, 32, 4)  # the last warp: 5 valid tiles (N % 896 == 864)
    assert launch(16, 16384, 16384) == ("whole", 8, 16, 8)  # 128 CTAs; "whole7": 114 or 133
    assert launch(16, 18432, 14336) == ("whole", 8, 18, 7)  # 126 CTAs either way: 8 x 32 tile-atoms a warp, not 7 x 38
    assert launch(16, 27648, 5120) == launch(9, 27648, 5120) == ("whole7", 8, 31, 4)  # splits of 20 atoms
    assert launch(16, 28672, 4096) == ("whole7", 8, 32, 4)  # splits of 16 atoms
    assert launch(16, 57344, 3584) == ("whole7", 8, 64, 2)  # splits of 28 atoms
    assert launch(16, 16384, 12288)[0] == launch(16, 16384, 8192)[0] == "wide"  # "whole": no producer warpgroup
    assert launch(8, 28672, 4096)[0] == "wide"  # one token tile: 32 atoms
    for n, k in ((11008, 28672), (9216, 12288), (14336, 4096), (22016, 4096), (18944, 3584)):
        assert launch(16, n, k)[0] == "wide"  # more than 8 splits, or splits of 8-11 atoms
    assert launch(16, 8192, 28672)[0] == launch(16, 8192, 12288)[0] == "narrow"  # one wave of 64-row CTAs
    assert launch(16, 128256, 4096) == ("whole", 8, 126, 1)  # one wave (not 144 CTAs of 7 warps)
    assert launch(16, 151936, 4096)[0] == "wide"  # 149 row tiles of 1024 rows: more than one wave


def test_w4a16_one_cta_per_sm_launches_a_producer_warpgroup():
    """Wide CTAs that hold an SM alone (32 and 64 tokens) and whole-SM CTAs (but "whole" at 16 tokens, whose fp16
    instance needs more registers than setmaxnreg leaves) launch their row warps' warpgroups and one more, whose
    first warp only issues the loads; two wide CTAs an SM (8 and 16 tokens) and narrow CTAs do not."""
    plan = functools.partial(budget.w4a16_launch, group_size=128, act_order=False, num_sms=132)
    seen = set()
    for m in (1, 8, 16, 32, 64):
        for n, k in ((28672, 8192), (8192, 8192), (8192, 28672), (16384, 12288), (16384, 16384), (14336, 4096),
                     (2048, 2048)):
            p = plan(m, n, k)
            warpgroups = 128 * -(-p.warps // 4)
            if p.form in ("narrow", "narrow32"):
                assert p.threads == 32 * (p.k_lanes + 1)
                continue
            one_cta_per_sm = budget.w4a16_plan(p.m_tiles, form=p.form).ctas_per_sm == 1
            producer = one_cta_per_sm and not (p.form == "whole" and p.m_tiles == 2)
            assert p.threads == warpgroups + (128 if producer else 0), (m, n, k, p)
            seen.add((p.form, p.m_tiles, producer))
    assert {("wide", 4, True), ("wide", 8, True), ("wide", 2, False), ("whole", 1, True), ("whole", 2, False),
            ("whole", 4, True), ("whole7", 2, True)} <= seen
    # two computing warpgroups and the producer's
    assert plan(32, 28672, 8192).threads == 384 and plan(16, 28672, 8192).threads == 384


def test_w4a16_workspace_follows_the_launch_plan():
    """The workspace the lowering allocates is the launcher's: split-K fragment-order partials (16 B per
    lane, m16 tile and token tile, per split), then the act-order gather of X (bf16), each 256-byte
    aligned. The split-K arrival counters are not workspace (csrc/common/arrival_counters.h)."""
    # 1 x 28672 x 8192 on 132 SMs (whole-SM CTAs): 14 warps x 4 tiles = 896 rows -> 32 column tiles -> 4 splits.
    partials = 16 * 32 * 4 * 14 * 4 * 1 * 32
    assert budget.w4a16_workspace_bytes(1, 28672, 8192, 128, act_order=False, num_sms=132) == partials
    gather = 2 * 1 * 8192
    assert budget.w4a16_workspace_bytes(1, 28672, 8192, 128, act_order=True, num_sms=132) == partials + gather
    # More SMs, more splits, more partials; shapes the kernel does not serve: -1.
    assert budget.w4a16_workspace_bytes(1, 28672, 8192, 128, act_order=False, num_sms=264) > partials
    # 14336 x 4096 at one token: 64 atoms, so at most 8 splits (kMaxShortSplits: fewer than 16 atoms each):
    # 32 column tiles of 7 warps x 4 m16 tiles in 8 splits. 4096 x 4096 runs narrow32 CTAs: no partials.
    assert budget.w4a16_workspace_bytes(1, 14336, 4096, 128, act_order=False, num_sms=132) == 16 * 32 * 8 * 7 * 4 * 32
    assert budget.w4a16_workspace_bytes(1, 4096, 4096, 128, act_order=False, num_sms=132) == 0
    # 4096 x 4096 at 64 tokens: at most 4 splits (kMaxSplitsAt64Tokens: their 64 KB partials are summed by one
    # CTA), so 32 column tiles of 4 warps x 2 m16 tiles x 8 token tiles -> 128 CTAs.
    assert budget.w4a16_workspace_bytes(64, 4096, 4096, 128, act_order=False, num_sms=132) == 16 * 32 * 4 * 4 * 2 * 8 * 32
    # Up to 16 tokens: more than 8 splits only when each streams >= 16 atoms (kMaxShortSplits). 9216 x 12288 (192
    # atoms) at 16 tokens: 36 column tiles of 4 warps x 4 m16 tiles x 2 token tiles in 7 splits; 9216 x 28672 (448
    # atoms) at 16 tokens: 18 tiles of 8 warps in 14 splits of 32 atoms. 8192 x 28672 at 8 tokens: whole-SM CTAs, 11
    # tiles of 12 warps in 12 splits of 37 atoms; at one token and at 16 it runs narrow, as 8192² does: no partials.
    assert budget.w4a16_workspace_bytes(16, 9216, 12288, 128, act_order=False, num_sms=132) == 16 * 36 * 7 * 4 * 4 * 2 * 32
    assert budget.w4a16_workspace_bytes(16, 9216, 28672, 128, act_order=False, num_sms=132) == 16 * 18 * 14 * 8 * 4 * 2 * 32
    long_k = functools.partial(budget.w4a16_workspace_bytes, n=8192, k=28672, group_size=128, act_order=False, num_sms=132)
    assert long_k(8) == 16 * 11 * 12 * 12 * 4 * 1 * 32
    for m, n, k in ((1, 8192, 8192), (16, 8192, 8192), (1, 8192, 28672), (16, 8192, 28672)):
        assert budget.w4a16_workspace_bytes(m, n, k, 128, act_order=False, num_sms=132) == 0
    assert budget.w4a16_workspace_bytes(1, 28672 + 16, 8192, 128, act_order=False, num_sms=132) == -1  # N % 32
    assert budget.w4a16_workspace_bytes(0, 28672, 8192, 128, act_order=False, num_sms=132) == -1


def test_w4a4_stream_k_workspace_follows_the_launch_plan():
    """Decode launches whose column tiles do not divide over the SMs deal (tile, k-stage) iterations over
    the CTAs (stream-K): their workspace is one fp32 partial tile (128 columns x the token tile) per CTA
    (the flags that publish them are arrival counters, csrc/common/arrival_counters.h), then (decode tiles,
    up to 32 tokens) the tokens' promotion records, m x k/64 x 8 bytes. Other launches need none."""
    def records(m, k):
        return m * (k // 64) * 8

    # Up to 16 tokens two CTAs per SM (264 CTAs); 32 and 64 tokens: 132 CTAs.
    # 1 x 28672 x 8192: 8-token tile, 224 column tiles on 264 CTAs.
    assert budget.w4a4_workspace_bytes(1, 28672, 8192, num_sms=132) == 264 * 128 * 8 * 4 + records(1, 8192)
    assert budget.w4a4_workspace_bytes(16, 28672, 8192, num_sms=132) == 264 * 128 * 16 * 4 + records(16, 8192)
    # 32-token tile: 224 column tiles on 132 CTAs (2 rounds where 1.7 would do).
    assert budget.w4a4_workspace_bytes(20, 28672, 8192, num_sms=132) == 132 * 128 * 32 * 4 + records(20, 8192)
    assert budget.w4a4_workspace_bytes(33, 28672, 8192, num_sms=132) == 132 * 128 * 64 * 4
    # 64 column tiles of 8192: fewer tiles than CTAs, also dealt over all of them.
    assert budget.w4a4_workspace_bytes(1, 8192, 8192, num_sms=132) == 264 * 128 * 8 * 4 + records(1, 8192)
    # No stream-K: tiles that divide over the CTAs, the cluster tiles (M > 64), or too little work per CTA.
    assert budget.w4a4_workspace_bytes(1, 128 * 264, 8192, num_sms=132) == records(1, 8192)
    assert budget.w4a4_workspace_bytes(20, 128 * 132, 8192, num_sms=132) == records(20, 8192)
    assert budget.w4a4_workspace_bytes(65, 28672, 8192, num_sms=132) == 0
    assert budget.w4a4_workspace_bytes(1, 128, 128, num_sms=132) == records(1, 128)
    assert budget.w4a4_workspace_bytes(0, 28672, 8192, num_sms=132) == 0


def test_w4a16_splits_come_in_whole_granules():
    """K splits come in whole granules of w4a16_split_granule atoms: any atom for wide and whole-SM splits, 2
    for a narrow K-split cluster's ranks (a 4-atom stage then starts on a 128-wide group)."""
    assert [budget.w4a16_split_granule(form) for form in budget.W4A16_FORMS] == [1, 1, 2, 2, 1]
    with pytest.raises(ValueError, match="form must be one of"):
        budget.w4a16_split_granule("paired")


def test_cli_describes_one_call_and_rejects_bad_shapes(capsys):
    """`python -m jax_w4a4.budget w4a16 M N K` / `w4a4 M N K` / `act_quant ROWS K`: how one call is launched,
    planned for --num-sms; shapes the kernels do not serve are said so, bad arguments are an error naming the
    argument."""
    budget.main(["--num-sms", "132", "w4a16", "1", "8192", "4096"])
    out = capsys.readouterr().out
    assert "narrow plan" in out and "128 CTAs" in out and "8 k-lanes in runs of 1 atom and" in out and "workspace 0 bytes" in out
    assert "evenly spaced stages" not in out
    budget.main(["--num-sms", "132", "w4a16", "16", "8192", "4096"])
    assert "12 k-lanes in runs of 1 atom and a producer warp: no split-K; the CTAs start K at 8 evenly spaced stages" in (
        capsys.readouterr().out)
    budget.main(["--num-sms", "132", "w4a16", "16", "28672", "8192"])
    out = capsys.readouterr().out
    assert "whole7 plan, 16-token tile" in out and "128 CTAs" in out and "8 row warps (896 rows)" in out
    assert "4 split(s) of 32 atoms" in out and "workspace 7340032 bytes" in out
    assert "the last of a row warp's splits sums its rows (256 arrival counters)" in out
    budget.main(["--num-sms", "132", "w4a16", "1", "1024", "4096"])  # a K-split cluster
    assert "32 rows and 1/2 of K a CTA (in granules of 2 atoms), 8 k-lanes in runs of 1 atom" in capsys.readouterr().out
    budget.main(["--num-sms", "132", "w4a16", "1", "100", "4096"])
    assert "not served" in capsys.readouterr().out
    budget.main(["--num-sms", "132", "act_quant", "4096", "4096"])
    assert "512 CTAs (64 row blocks x 8 K split(s))" in capsys.readouterr().out
    budget.main(["--num-sms", "132", "w4a4", "8192", "8192", "8192"])
    out = capsys.readouterr().out
    assert "256-token tile, clusters of 2, e4m3 weights expanded into the workspace first" in out
    assert f"workspace {8192 * 8192} bytes" in out
    budget.main(["--num-sms", "132", "w4a4", "16", "28672", "8192"])
    assert "16-token tile, clusters of 1, int4 weights" in capsys.readouterr().out
    budget.main(["--num-sms", "132", "w4a4", "8192", "8192", "8192", "--act-format", "fp8"])
    assert "fp8 on 132 SMs: 128-token tile, clusters of 2, e4m3 weights" in capsys.readouterr().out
    budget.main(["w4a16", "16", "8192", "4096", "--num-sms", "66"])  # after the subcommand too
    assert "on 66 SMs" in capsys.readouterr().out
    budget.main(["act_quant", "4096", "4096", "--num-sms", "66"])
    assert "on 66 SMs" in capsys.readouterr().out
    for argv, message in ((["act_quant", "4096", "100"], "K must be a multiple of 64"),
                          (["act_quant", "4096", "4096", "--rank", "17"], "rank (the low-rank rank r)"),
                          (["w4a4", "16", "100", "4096"], "N must be a multiple of 128"),
                          (["w4a4", "0", "128", "4096"], "M must be at least 1"),
                          (["--num-sms", "0", "w4a16", "1", "4096", "4096"], "--num-sms must be at least 1"),
                          (["w4a16", "1", "4096", "4096", "--num-sms", "-2"], "--num-sms must be at least 1")):
        with pytest.raises(SystemExit):
            budget.main(argv)
        assert message in capsys.readouterr().err
    budget.main([])
    assert capsys.readouterr().out == budget.table()


def test_planner_library_follows_the_cuda_library_override(tmp_path, monkeypatch):
    """With $JAX_W4A4_LIBRARY naming a build that has a planner library beside it, that planner sizes the workspaces
    (the build's handlers check them against its own plans); with none beside it, the default search."""
    monkeypatch.delenv("JAX_W4A4_LIBRARY", raising=False)
    default = budget.library_path()
    build = tmp_path / "libjax_w4a4.so"
    build.write_bytes(b"")
    monkeypatch.setenv("JAX_W4A4_LIBRARY", str(build))
    assert budget.library_path() == default
    beside = tmp_path / budget.LIBRARY_NAME
    beside.write_bytes(b"")
    assert budget.library_path() == beside


def test_cli_runs_as_a_module_without_warnings():
    """The documented command itself, with runtime warnings as errors: runpy used to warn that the module it ran
    had already been imported by the package (now a package __main__)."""
    run = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "jax_w4a4.budget", "--num-sms", "132",
                          "w4a16", "1", "8192", "8192"], capture_output=True, text=True, check=False, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "Warning" not in run.stderr
    assert "narrow plan, 8-token tile" in run.stdout
