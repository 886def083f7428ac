"""w4a16_gemm's launch forms on the GPU against jax_w4a4.reference.w4a16_gemm, each on shapes the planner sends
to it (asserted through jax_w4a4.budget): narrow CTAs and their K-split clusters, narrow CTAs that start K in
phases, whole-SM CTAs (also planned for 8 SMs), and the reductions (split-K arrival counters re-armed, split-K,
k-lane and cluster sums deterministic). How kernel and reference are compared: w4a16_support.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from jax_w4a4 import budget
from jax_w4a4.ops import _library
from tests.gpu.w4a16_support import BF16, FP16, activations, kernel, num_sms, run_and_compare, weights

pytestmark = pytest.mark.gpu


def test_split_k_counters_are_rearmed():
    """Nothing zeroes the split-K arrival counters before a launch (csrc/common/arrival_counters.h): each
    launch must leave them at 0. Runs the same split-K call sites on new data each time (a counter left
    armed would skip or misplace a tile's reduction), then reads every counter back."""
    split_calls = ((1, 14336, 4096), (16, 9216, 12288), (3, 8480, 1024))
    assert all(budget.w4a16_launch(m, n, k, 64, act_order=False, num_sms=num_sms()).splits > 1 for m, n, k in split_calls)
    for seed in range(3):
        for m, n, k in split_calls:
            run_and_compare(activations((m,), k, BF16, seed=seed), n, k, 64, seed % 2 == 1, BF16, False, True)
    assert _library.armed_arrival_counters() == 0


@pytest.mark.parametrize(
    "n, k, narrow, splits", [(9216, 12288, False, 7), (1536, 576, True, 1), (512, 4096, True, 4)],
    ids=["split-k", "narrow", "narrow-cluster"],
)
def test_reductions_are_deterministic(n, k, narrow, splits):
    """Split-K sums its partials in split order (arrival counters), narrow CTAs their k-lanes' in lane order and
    a narrow K-split cluster its ranks' in rank order."""
    plan = budget.w4a16_launch(16, n, k, 64, act_order=True, num_sms=num_sms())
    assert (plan.narrow, plan.splits) == (narrow, splits)
    _, packed, scales, zeros, g_idx, bias = weights(n, k, 64, True, FP16, True)
    x = activations((16,), k, FP16)
    first = np.asarray(kernel(x, packed, scales, zeros, g_idx, bias, group_size=64))
    for _ in range(3):
        again = np.asarray(kernel(x, packed, scales, zeros, g_idx, bias, group_size=64))
        np.testing.assert_array_equal(again.view(np.uint16), first.view(np.uint16))


# (n, k, group size, zero points, dtype) that the planner runs narrow and unsplit at 1, 5 and 16 tokens
NARROW_CASES = {
    "narrow32": ((96, 576, 32, True, BF16), (2144, 1024, -1, False, FP16), (2144, 1024, 128, False, BF16),
                 (2208, 1536, 64, True, FP16)),
    "narrow": ((4256, 576, 32, True, FP16), (4320, 1024, -1, False, BF16), (4320, 1024, 128, True, FP16),
               (4320, 3072, 64, True, FP16)),
}


@pytest.mark.parametrize("form", list(NARROW_CASES))
@pytest.mark.parametrize("m", [1, 5, 16])
def test_narrow_ctas(form, m):
    """Narrow CTAs (small layers, up to 16 tokens) of 32 rows (narrow32) and 64 (narrow): K's last stage partial
    (9 atoms: 3 stages of 4, so 3 k-lanes, in runs of 1 atom: a 128-wide group split between two lanes) or
    whole, a last row tile of 32 rows in a 64-row form (N % 64 == 32), every group size, both zero-point modes;
    and K of 48 atoms, which launches the most k-lanes a narrow CTA has (8, 12 at 16 tokens). Runs of whole
    stages (K > 8192): the decode shapes' 8192 x 28672."""
    for n, k, group_size, zero_point, dtype in NARROW_CASES[form]:
        size = k if group_size == -1 else group_size
        plan = budget.w4a16_launch(m, n, k, size, act_order=False, num_sms=num_sms())
        assert plan.form == form and plan.lane_atoms == 1 and plan.splits == 1
        run_and_compare(activations((m,), k, dtype, seed=m), n, k, group_size, zero_point, dtype, False, True)


# (tokens, n, k, group size, zero points, dtype, act-order) whose narrow CTAs start K in phases (NarrowKPhases)
PHASED_CASES = (
    (8, 8192, 2048, 32, True, FP16, False),  # 8 stages: a phase each
    (16, 4096, 3072, -1, False, BF16, False),  # narrow32, per channel
    (13, 7424, 4096, 128, True, BF16, True),  # 116 CTAs, two token tiles, act-order
    (8, 7424, 8448, 64, False, FP16, False),  # runs of whole stages
    (9, 8448, 11008, -1, False, BF16, False),  # two token tiles at long K (runs of one atom), per channel, 132 CTAs
)


@pytest.mark.parametrize("case", PHASED_CASES, ids=lambda c: f"m{c[0]}-{c[1]}x{c[2]}-g{c[3]}")
def test_narrow_ctas_in_k_phases(case):
    """Narrow CTAs that start K at one of 8 evenly spaced stages by row tile and wrap around: every group size's
    boundaries, zero points and act-order stay with their atoms, at one and two token tiles, in runs of one atom
    and of whole stages."""
    m, n, k, group_size, zero_point, dtype, act_order = case
    size = k if group_size == -1 else group_size
    plan = budget.w4a16_launch(m, n, k, size, act_order=act_order, num_sms=num_sms())
    assert plan.narrow and plan.splits == 1 and plan.k_phases == 8, plan
    run_and_compare(activations((m,), k, dtype, seed=m), n, k, group_size, zero_point, dtype, act_order, True)


# (n, k, group size, zero points, dtype, act-order, tokens) -> the narrow form and the K-split cluster it runs
CLUSTER_CASES = {
    (1024, 4096, 128, False, BF16, False, 1): ("narrow32", 2),  # 32 clusters of 4 would not fit one wave
    (1024, 4096, 32, True, FP16, True, 16): ("narrow32", 2),
    (512, 4096, 64, True, BF16, False, 16): ("narrow32", 4),
    (608, 4160, 64, True, FP16, False, 5): ("narrow32", 4),  # 65 atoms: ranks of 16, 16, 16 and 17
    (1056, 2304, 128, True, BF16, False, 1): ("narrow32", 2),  # 18 atoms a rank: a partial last stage
    (1056, 2048, -1, False, FP16, False, 16): ("narrow32", 2),  # per channel: the split cuts the group
    (2048, 20480, 128, True, BF16, False, 1): ("narrow", 2),  # 160 atoms a CTA: runs of whole stages
    (4064, 12288, 64, False, FP16, True, 5): ("narrow", 2),  # N % 64 == 32
    (3072, 11008, 64, True, BF16, False, 16): ("narrow", 2),  # two token tiles, 86 atoms a CTA
    (1024, 28672, 128, False, FP16, False, 9): ("narrow", 4),
    (3584, 18944, 128, True, BF16, True, 16): ("narrow", 2),  # two token tiles, 148 atoms a CTA
}


@pytest.mark.parametrize("case", list(CLUSTER_CASES), ids=lambda c: f"{c[0]}x{c[1]}-g{c[2]}-m{c[6]}")
def test_narrow_k_split_clusters(case):
    """Narrow CTAs whose row tile's K is split over a cluster of 2 or 4 CTAs (rank 0 adds the others'
    accumulators from its shared memory): uneven and group-cutting splits, every group size, both zero-point
    modes, act-order, 1 to 16 tokens."""
    n, k, group_size, zero_point, dtype, act_order, m = case
    size = k if group_size == -1 else group_size
    plan = budget.w4a16_launch(m, n, k, size, act_order=act_order, num_sms=num_sms())
    assert (plan.form, plan.splits) == CLUSTER_CASES[case]
    assert budget.w4a16_workspace_bytes(m, n, k, size, act_order=act_order, num_sms=num_sms()) == (
        2 * m * k if act_order else 0
    )
    run_and_compare(activations((m,), k, dtype, seed=m), n, k, group_size, zero_point, dtype, act_order, True)


@pytest.mark.parametrize("m", [1, 8, 9, 16, 17, 32])
def test_whole_sm_ctas(m):
    """Whole-SM CTAs (splits of >= 32 atoms, whole7 >= 16: one CTA per SM; at one token tile up to 16 row warps of 4
    m16 tiles, 1024 rows; at the 16-token tile 8 row warps of 8 tiles ("whole") or 7 ("whole7", 896 rows) on
    mma.sync, at the 32-token tile 7 or 8 of 4 on wgmma): both zero-point modes, bf16 and fp16, act-order, 32-wide
    groups, and a last warp with one valid pair of m16 tiles (N % 64 == 32) or, in "whole7", an odd number of valid
    tiles (5 and 1). The decode shapes' 28672 x 8192 runs them too (at 1, 3 and 16 tokens)."""
    if 8 < m <= 16:
        cases = [
            (28640, 8192, 128, True, FP16, False),  # whole7: the last warp holds 5 valid tiles
            (28576, 8192, 64, False, BF16, True),  # whole7: the last warp holds 1
            (32768, 8192, 32, True, BF16, True),  # whole: 1024-row CTAs
            (28672, 4096, 128, False, BF16, False),  # whole7 in splits of 16 atoms
        ]
    else:
        cases = [(18432, 8192, 128, True, FP16, False), (18400, 8192, 64, False, BF16, True)]
        if m > 16:
            cases.append((8192, 16384, 32, True, BF16, True))  # 8 row warps: no warp without rows
    plans = set()
    for n, k, group_size, zero_point, dtype, act_order in cases:
        plan = budget.w4a16_launch(m, n, k, group_size, act_order=act_order, num_sms=num_sms())
        assert plan.form in ("whole", "whole7")
        plans.add((plan.form, plan.warps))
        run_and_compare(activations((m,), k, dtype, seed=m), n, k, group_size, zero_point, dtype, act_order, True)
    if m <= 8:
        assert {form for form, _ in plans} == {"whole"} and min(warps for _, warps in plans) > 8
    elif m <= 16:
        assert plans == {("whole7", 8), ("whole", 8)}
    else:
        assert plans == {("whole", 7), ("whole", 8)}


# (n, k, group size, zero points, dtype, act-order), planned for 8 SMs -> the form at 1 / 16 / 32 tokens
FEW_SMS_CASES = {
    (1760, 8192, 64, True, FP16, False): ("whole", "whole7", "whole"),  # whole7: the last warp holds 5 valid tiles
    (2048, 8192, 32, False, BF16, True): ("whole", "whole", "whole"),  # 1024-row 16-token CTAs
    (1792, 8192, 128, False, BF16, False): ("whole", "whole7", "whole"),
}


@pytest.mark.parametrize("m", [1, 16, 32])
def test_whole_sm_ctas_planned_for_few_sms(m, monkeypatch):
    """The whole-SM forms on layers small enough for compute-sanitizer (benchmarks/sanitize.sh), planned for 8
    SMs: the lowering plans for `_library.cuda_sm_count()` SMs, and another count changes only how the work is
    split. Shapes of their own, so that no other test's compiled call is reused."""
    monkeypatch.setattr(_library, "cuda_sm_count", lambda: 8)
    _, packed, scales, zeros, g_idx, bias = weights(1792, 8192, 128, False, BF16, False)
    lowered = kernel.lower(activations((m,), 8192, BF16), packed, scales, zeros, g_idx, bias, group_size=128)
    assert "num_sms = 8 : i64" in lowered.as_text()  # the kernel plans for what the budget calls below plan for
    for (n, k, group_size, zero_point, dtype, act_order), forms in FEW_SMS_CASES.items():
        plan = budget.w4a16_launch(m, n, k, group_size, act_order=act_order, num_sms=8)
        assert plan.form == forms[[1, 16, 32].index(m)] and plan.n_tiles * plan.splits == 8
        run_and_compare(activations((m,), k, dtype, seed=m), n, k, group_size, zero_point, dtype, act_order, True)
