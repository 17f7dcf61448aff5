"""The balancer's planner (services/model/experts/eplb.py): exact placements for known loads; expert
settings that cannot work refused before anything loads."""

from __future__ import annotations

import pytest

from services.model.experts import eplb
from services.settings import SettingsError, build, check

# 8 experts, expert 0 hot and expert 4 warm; 10 slots over 2 ranks (5 each)
LOAD = [100, 5, 5, 5, 60, 5, 5, 5]


def test_the_initial_placement_copies_the_first_experts_into_the_redundant_slots():
    assert eplb.initial(8, 10) == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    assert eplb.initial(4, 4) == [0, 1, 2, 3]


def test_copies_go_to_the_most_load_per_copy():
    assert eplb.replicate(LOAD, 10) == [2, 1, 1, 1, 2, 1, 1, 1]
    assert eplb.replicate(LOAD, 12) == [4, 1, 1, 1, 2, 1, 1, 1]  # 100/3 > 60/2 > 100/4
    assert eplb.replicate([1, 1, 1], 3) == [1, 1, 1]


def test_the_global_policy_balances_the_ranks_exactly_here():
    current = eplb.initial(8, 10)
    # rank 0: 100 / 2 + 5 / 2 + 5 + 5 + 60 of a mean 95
    assert eplb.imbalance(LOAD, current, 2) == pytest.approx(122.5 / 95)
    placed = eplb.plan(LOAD, current, 2)
    # the copies of each hot expert on both ranks; each rank's load 95 of 190
    assert sorted(placed[:5]) == [0, 1, 3, 4, 6] and sorted(placed[5:]) == [0, 2, 4, 5, 7]
    assert eplb.imbalance(LOAD, placed, 2) == 1.0
    assert sorted(placed) == sorted([0, 0, 1, 2, 3, 4, 4, 5, 6, 7])


def test_an_expert_staying_on_its_rank_keeps_its_slot():
    current = eplb.initial(8, 10)  # rank 0: 0 1 2 3 4, rank 1: 5 6 7 0 1
    placed = eplb.plan(LOAD, current, 2)
    for r in range(2):
        span = slice(r * 5, (r + 1) * 5)
        for slot, (was, now) in enumerate(zip(current[span], placed[span], strict=True)):
            if was in placed[span]:
                assert now == was, (r, slot)


def test_the_hierarchical_policy_keeps_each_expert_group_on_one_node():
    # 4 groups of 2 experts: {0,1}=105 {2,3}=10 {4,5}=65 {6,7}=10; 2 nodes of 1 rank each
    placed = eplb.plan(LOAD, eplb.initial(8, 10), 2, "hierarchical", nodes=2, groups=4)
    assert sorted(set(placed[:5])) == [0, 1, 6, 7]  # the hottest group and the last one
    assert sorted(set(placed[5:])) == [2, 3, 4, 5]
    # groups cannot cross nodes: 115 of a mean 95 (global: 1.0)
    assert eplb.imbalance(LOAD, placed, 2) == pytest.approx(115 / 95)


def test_policies_are_chosen_as_deepseek_describes():
    assert eplb.choose_policy("auto", 1, 8, 4, 16) == "global"
    assert eplb.choose_policy("auto", 2, 8, 4, 16) == "hierarchical"
    assert eplb.choose_policy("auto", 3, 8, 4, 16) == "global"  # 3 nodes do not divide 8 groups
    assert eplb.choose_policy("global", 2, 8, 4, 16) == "global"
    with pytest.raises(ValueError, match="divid"):
        eplb.choose_policy("hierarchical", 1, 8, 4, 16)


def test_imbalance_counts_each_copy_as_half_the_load():
    assert eplb.imbalance([10, 0], [0, 1], 2) == 2.0  # all on rank 0: max 10, mean 5
    assert eplb.imbalance([10, 0], [0, 0], 2) == 1.0  # two copies, one on each rank
    assert eplb.imbalance([0, 0], [0, 1], 2) == 1.0


@pytest.mark.parametrize(
    ("family", "values", "message"),
    [
        ("qwen3", {"expert_parallel": 2}, "is not a mixture-of-experts model"),
        (
            "qwen3_moe",
            {"expert_parallel": 2, "redundant_experts": 1},
            "8 experts \\+ 1 redundant slots do not divide over 2 ranks",
        ),
        (
            "deepseek_v3",
            {"expert_parallel": 2, "eplb_policy": "hierarchical"},
            "the hierarchical policy needs --eplb-nodes > 1",
        ),
    ],
)
def test_expert_settings_that_cannot_work_are_refused_before_anything_loads(
    tiny_dir, family, values, message
):
    with pytest.raises(SettingsError, match=message):
        check(build("decode", model=str(tiny_dir(family)), **values))
    check(build("decode", model=str(tiny_dir("deepseek_v3")), expert_parallel=2,
                eplb_policy="hierarchical", eplb_nodes=2))  # fmt: skip  # 4 groups over 2 nodes
