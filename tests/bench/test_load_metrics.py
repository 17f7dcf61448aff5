"""The load client's arithmetic on synthetic timelines with known answers (TTFT, TPOT, ITL,
percentiles, goodput), its arrival process, and its workloads' exact token counts."""

from __future__ import annotations

import itertools
import json
import math
import statistics

import pytest

from bench.load.metrics import SLO, RequestRecord, summarize, timeline
from bench.load.runner import LoadConfig, arrivals
from bench.load.workloads import Conversation, Turn, WorkloadConfig, build


def records() -> list[RequestRecord]:
    a = RequestRecord(
        start=0.0, input_tokens=10, chunk_times=[0.5, 0.6, 0.8, 1.0], end=1.0, output_tokens=4
    )
    b = RequestRecord(start=1.0, input_tokens=20, chunk_times=[1.2, 1.5], end=1.6, output_tokens=2)
    failed = RequestRecord(start=0.2, input_tokens=5, end=0.3, error="HTTP 500: boom")
    return [a, b, failed]


def test_per_request_figures():
    a, b, failed = records()
    assert a.ttft == pytest.approx(0.5) and b.ttft == pytest.approx(0.2)
    assert a.itls == pytest.approx([0.1, 0.2, 0.2]) and b.itls == pytest.approx([0.3])
    assert a.tpot == pytest.approx((1.0 - 0.5) / 3) and b.tpot == pytest.approx(0.4)
    assert a.latency == 1.0 and not failed.ok and math.isnan(failed.ttft)
    one = RequestRecord(start=0, input_tokens=1, chunk_times=[0.1], end=0.1, output_tokens=1)
    assert one.tpot is None  # TPOT needs two tokens


def test_summary_and_percentiles():
    s = summarize(records(), duration=2.0, slo=SLO())
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["failure_reasons"] == {"HTTP 500: boom": 1}
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (30, 6)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.0
    assert s["total_token_throughput"] == 18.0
    assert s["mean_ttft_ms"] == pytest.approx(350) and s["median_ttft_ms"] == pytest.approx(350)
    assert s["p99_ttft_ms"] == pytest.approx(200 + 0.99 * 300)  # linear between 200 and 500
    assert s["p90_ttft_ms"] == pytest.approx(200 + 0.90 * 300)
    assert s["mean_itl_ms"] == pytest.approx(200) and s["median_itl_ms"] == pytest.approx(200)
    assert s["p99_itl_ms"] == pytest.approx(200 + 0.97 * 100)  # 100,200,200,300: rank 2.97
    assert s["mean_tpot_ms"] == pytest.approx((500 / 3 + 400) / 2)
    assert s["mean_e2el_ms"] == pytest.approx(800) and s["p99_e2el_ms"] == pytest.approx(996)
    assert s["std_ttft_ms"] == pytest.approx(150)
    assert s["request_goodput"] is None  # no SLO given


@pytest.mark.parametrize(
    ("slo", "goodput"),
    [
        (["ttft:300"], 0.5),  # b only
        (["tpot:200"], 0.5),  # a only (166.7 ms)
        (["e2el:1000"], 1.0),  # both (1000 and 600 ms)
        (["ttft:600", "tpot:500", "e2el:700"], 0.5),  # b only: a's 1000 ms is too long
        (["ttft:100"], 0.0),
    ],
)
def test_goodput_counts_requests_meeting_every_slo(slo, goodput):
    assert summarize(records(), 2.0, SLO.parse(slo))["request_goodput"] == goodput


def test_slo_parse_refuses_unknown_keys():
    with pytest.raises(ValueError, match="ttft:MS"):
        SLO.parse(["latency:5"])


def test_timeline_buckets_tokens_and_concurrency():
    series = timeline(records(), step=0.5)
    assert series["t"] == [0.0, 0.5, 1.0, 1.5]
    # tokens per bucket: a 3 | a 1 + b 1 ... as tokens/s over 0.5 s buckets
    assert series["output_throughput"] == [0.0, 6.0, 4.0, 2.0]
    assert series["concurrency"] == [1.0, 1.0, 1.0, 1.0]


def test_arrivals_rate_and_burstiness():
    conversations = [Conversation([Turn("x", 1)]) for _ in range(20000)]
    assert set(arrivals(conversations[:10], LoadConfig())) == {0.0}  # inf: all at once
    for burstiness in (1.0, 0.25):
        times = list(arrivals(conversations, LoadConfig(request_rate=50, burstiness=burstiness)))
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.05)
        cv = statistics.pstdev(gaps) / statistics.mean(gaps)  # gamma: 1 / sqrt(shape)
        assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    trace = [Conversation([Turn("x", 1)], arrival=t) for t in (0.0, 0.25, 2.0)]
    assert list(arrivals(trace, LoadConfig(request_rate=1))) == [0.0, 0.25, 2.0]


def test_workloads_have_exact_token_counts(embedded):
    tok = embedded.tokenizer
    random_ = build(WorkloadConfig("random", 20, 100, 8, range_ratio=0.5, seed=1), tok)
    for c in random_:
        (turn,) = c.turns
        assert len(tok.encode(turn.user, False)) == turn.input_tokens
        assert 50 <= turn.input_tokens <= 150 and 4 <= turn.output_tokens <= 12
    shared = build(WorkloadConfig("shared-prefix", 8, 16, 4, prefix_len=64, groups=2), tok)
    assert len({c.system for c in shared}) == 2
    assert all(len(tok.encode(c.system or "", False)) == 64 for c in shared)
    multi = build(WorkloadConfig("multi-turn", 3, 10, 5, turns=4), tok)
    assert [len(c.turns) for c in multi] == [4, 4, 4]
    rag = build(WorkloadConfig("rag", 12, 10, 4, documents=5, document_len=32,
                               documents_per_request=3, seed=2), tok)  # fmt: skip
    pool = {d for c in rag for d in c.turns[0].documents}
    assert len(pool) == 5 and all(len(tok.encode(d, False)) == 32 for d in pool)
    orders = {tuple(c.turns[0].documents) for c in rag}
    assert len(orders) > 6  # drawn and shuffled per request
    for c in rag:
        (turn,) = c.turns
        assert len(turn.documents) == 3 and len(set(turn.documents)) == 3
        assert turn.input_tokens == 3 * 32 + len(tok.encode(turn.user, False)) == 3 * 32 + 10


def test_trace_and_sharegpt_files(embedded, tmp_path):
    tok = embedded.tokenizer
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 40, "output_length": 5, "hash_ids": [7, 8]},
        {"timestamp": 1500, "input_length": 30, "output_length": 6, "hash_ids": [7]},
        {"timestamp": 4000, "input_length": 10, "output_length": 2},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    config = WorkloadConfig("trace", 0, dataset_path=trace, trace_block_size=16)
    replay = build(config, tok)
    assert [c.arrival for c in replay] == [0.0, 0.5, 3.0]
    ids = [tok.encode(c.turns[0].user, False) for c in replay]
    assert [len(i) for i in ids] == [40, 30, 10]
    assert ids[0][:16] == ids[1][:16] and ids[0][16:32] != ids[1][16:32]  # hash 7 shared
    sharegpt = tmp_path / "sharegpt.json"
    talk = [
        {"from": "human", "value": "Tell me about the sea and its tides, please."},
        {"from": "gpt", "value": "The sea rises and falls twice a day with the moon."},
    ]
    sharegpt.write_text(json.dumps([{"conversations": talk}, {"conversations": talk[:1]}]))
    (only,) = build(WorkloadConfig("sharegpt", 10, dataset_path=sharegpt), tok)
    assert only.turns[0].output_tokens == len(tok.encode(talk[1]["value"], False))
