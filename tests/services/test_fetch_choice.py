"""Fetch or compute (services/worker/fetch_choice.py): the rates learned from measurements,
and the plan they give."""

from __future__ import annotations

import time

import pytest

from services.model.config import ModelConfig
from services.worker.fetch_choice import (
    ALPHA,
    RESAMPLE_S,
    Choice,
    LinkRate,
    PromptRate,
    attention_k,
)


def test_link_rate_is_round_trips_and_bytes_per_second():
    link = LinkRate()
    assert link.seconds(1 << 20, 1) is None  # unmeasured
    link.observe(100, 0.002)  # small: a round trip
    link.observe(10_000_000, 0.102)  # 10 MB in 0.1 s past the round trip
    assert link.rtt == 0.002 and link.bytes_per_s == pytest.approx(1e8)
    assert link.seconds(50_000_000, 5) == pytest.approx(5 * 0.002 + 0.5)
    link.observe(10_000_000, 0.202)  # slower now: seconds per byte smoothed, ALPHA the newest's
    assert 1 / link.bytes_per_s == pytest.approx((1 - ALPHA) / 1e8 + ALPHA / 5e7)


def test_prompt_rate_predicts_longer_prompts_and_offsets():
    rate = PromptRate(k=4000)
    assert rate.seconds(0, 1000) is None
    rate.observe(0, 16, 1.0)  # too short to measure
    assert rate.seconds_per_unit is None
    rate.observe(0, 1000, 1.125)  # 1000 + 500_000 / 4000 = 1125 units
    assert rate.seconds_per_unit == pytest.approx(0.001)
    assert rate.seconds(0, 4000) == pytest.approx(0.001 * (4000 + 8_000_000 / 4000))
    assert rate.seconds(4000, 1000) == pytest.approx(0.001 * (1000 + 4_500_000 / 4000))


def choice(mode: str = "auto") -> Choice:
    c = Choice(mode, k=4000, block_tokens=16, batch=8, pause=0.005)
    c.observe_read(0, 0, 0.001)  # round trip 1 ms
    return c


def test_plan_reads_until_both_rates_are_measured_then_the_faster():
    c = choice()
    assert (c.plan(0, 100).blocks, c.plan(0, 100).why) == (100, "unmeasured")
    c.observe_read(8 * 400_000, 8, 0.001 + 0.032)  # 400 kB blocks at 100 MB/s
    c.prompts.observe(0, 1600, 1.6 * (1 + 800 / 4000))  # 1 ms per token, short context
    # 100 blocks: 13 reads, 40 MB -> 0.013 + 0.4 + 12 pauses = 0.473 s; computing 1600
    # tokens: 1.6 * 1.2 = 1.92 s
    plan = c.plan(0, 100)
    assert (plan.blocks, plan.why) == (100, "fetch")
    assert plan.fetch_s == pytest.approx(0.473) and plan.compute_s == pytest.approx(1.92)
    c.observe_read(8 * 400_000, 8, 0.001 + 3.2)  # the link slows a hundredfold
    assert 1 / c.link.bytes_per_s == pytest.approx((1 - ALPHA) / 1e8 + ALPHA / 1e6)
    plan = c.plan(0, 100)  # one slow read: 30% of the way, and computing is sooner already
    assert (plan.blocks, plan.why) == (0, "compute") and plan.fetch_s > plan.compute_s
    assert c.plan(10, 0).blocks == 0  # nothing missing


def test_a_stale_link_is_measured_again_with_one_batch():
    c = choice()
    c.observe_read(8 * 400_000, 8, 3.2)
    c.prompts.observe(0, 1600, 0.1)
    c.link.at = time.monotonic() - RESAMPLE_S - 1
    plan = c.plan(0, 100)
    assert (plan.blocks, plan.why) == (1, "resample")  # 1 MB/s: a block a read (0.1 s)


def test_modes_always_and_never_ignore_the_rates():
    assert choice("always").plan(3, 50).blocks == 50
    assert choice("never").plan(3, 50).blocks == 0


def test_attention_k_of_a_llama_shape():
    config = ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        max_position_embeddings=8192,
        architecture="LlamaForCausalLM",
        tie_word_embeddings=True,
        attention_bias=False,
    )
    weights = 30 * (576 * (2 * 576 + 2 * 192) + 3 * 576 * 1536) + 49152 * 576
    assert attention_k(config) == pytest.approx(weights / (2 * 30 * 576))


def test_a_split_computes_the_head_while_the_tail_is_read_where_both_take_as_long():
    c = choice()
    c.observe_read(8 * 400_000, 8, 0.32)  # 10 MB/s: 40 ms a block
    c.prompts.observe(0, 1600, 1.6 * (1 + 800 / 4000))  # 1 ms per unit
    whole = c.plan(0, 100)  # reading alone (4 s) or computing alone (1600 tokens: 1.92 s)
    split = c.plan(0, 100, split=True)
    assert (whole.why, whole.blocks, whole.head) == ("compute", 0, 0)
    assert split.why == "split" and split.head + split.blocks == 100

    def both(head: int) -> float:
        return max(c._compute_s(0, head), c._fetch_s(100 - head))

    assert split.split_s == pytest.approx(both(split.head))
    assert split.split_s + 0.05 < 0.85 * min(split.fetch_s, split.compute_s)
    assert all(both(h) >= split.split_s for h in range(1, 100))  # the best head
    c.observe_read(8 * 400_000, 8, 20.0)  # the link much slower: computing wins outright
    for _ in range(10):
        c.observe_read(8 * 400_000, 8, 20.0)
    assert c.plan(0, 100, split=True).why == "compute"


def test_splits_slower_than_expected_make_the_next_ones_expected_slower():
    c = choice()
    c.observe_read(8 * 400_000, 8, 0.32)
    c.prompts.observe(0, 1600, 1.6 * (1 + 800 / 4000))
    first = c.plan(0, 100, split=True)
    assert first.why == "split"
    for _ in range(3):  # the two halves slowed each other: 1.4x what was expected each time
        c.observe_split(c.plan(0, 100, split=True).split_s, 1.4 * first.split_s)
    assert c.split_factor == pytest.approx(1 + 0.4 * (1 - 0.7**3))
    assert c.plan(0, 100, split=True).why == "compute"  # the split no longer pays
    for _ in range(20):  # then splits as fast as expected: the factor comes back to 1
        c.observe_split(1.0, 1.0 / c.split_factor)
    assert c.split_factor == pytest.approx(1.0, abs=0.01)
    assert c.plan(0, 100, split=True).why == "split"


def test_reads_shrink_on_a_slow_link_to_a_tenth_of_a_second():
    c = choice()
    assert c.read_blocks() == 8  # unmeasured
    c.observe_read(8 * 400_000, 8, 0.032)  # 100 MB/s: 25 blocks in 0.1 s, 8 at most
    assert c.read_blocks() == 8
    c.link.per_byte = 1 / 12.5e6  # 0.1 Gbit/s: 3 blocks of 400 kB in 0.1 s
    assert c.read_blocks() == 3
    c.link.per_byte = 1 / 1e6
    assert c.read_blocks() == 1
