"""The compile-time shared-memory plans: every amortize-vs-replicate decision, and that the solver is tight.

Hopper rules (TMA multicast): the footprint of a multicast object is REPLICATED in every CTA of the
cluster, each CTA ISSUES only its slice, and each CTA's full barrier EXPECTS the whole tile.
"""

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


@pytest.mark.parametrize("shape", [(128, 16, 1, 64), (128, 32, 1, 64), (128, 64, 2, 64), (128, 128, 2, 32)])
def test_instantiated_plans_fit_and_are_tight(shape):
    plan = budget.w4a4_plan(*shape)
    assert plan.total_bytes <= budget.SMEM_PER_BLOCK
    assert plan.main_stages >= 3
    assert plan.total_bytes == sum(o.footprint for o in plan.objects)
    if plan.main_stages < 8:  # the solver stopped because one more stage would not fit
        assert plan.total_bytes + plan.main_stage_bytes > budget.SMEM_PER_BLOCK - 16


def test_main_stages_come_before_low_rank_stages():
    plan = budget.w4a4_plan(128, 128, 2, lora_chunk=64)
    assert plan.main_stages >= 3
    assert plan.lora_stages == 1  # two low-rank stages of 64 ranks would push the main loop under 3


def test_stage_bytes_follow_the_tile():
    plan = budget.w4a4_plan(128, 32, 1)
    assert plan.object("weights").bytes == 128 * 128 // 2  # int4: half a byte per value
    assert plan.object("activations").bytes == 32 * 128  # one e4m3 code per value
    assert plan.object("weight scales").bytes == 128 * 2 * 2  # two groups of 64 per stage, 16-bit
    assert plan.object("LA chunk (fp32").bytes == 32 * 64 * 4


def test_table_lists_every_instantiated_plan():
    text = budget.table()
    assert text.count("w4a4_gemm sm90:") == 4
    assert "DOES NOT FIT" not in text
