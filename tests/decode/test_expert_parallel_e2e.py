"""`pdserve up --expert-parallel 2` over a MoE checkpoint made by transformers: the worker's
experts on two processes, rebalanced every 3 forward passes while streams run, answer as one
process does, through the router and the official client; an expert rank killed mid-stream
takes its worker out of service (exit code 1, restarted by `up`) and the stream completes on
the restarted worker, token for token; nothing hangs."""

from __future__ import annotations

import signal

import httpx
import openai
import psutil
from prometheus_client.parser import text_string_to_metric_families

from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.launcher import free_port
from services.model.loader import load_model
from tests.support.up import Up, stream_completion

PROMPT = "The lighthouse keeper climbed the stairs and"
NAME = "tiny-moe"


def test_spread_experts_answer_as_one_process_and_a_dead_rank_restarts_its_worker(tiny_dir):
    path = tiny_dir("qwen3_moe")
    loaded = load_model(str(path), dtype="float32", device="cpu")
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=128))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = engine.generate([PROMPT], params)[0].choices[0].text
    metrics = free_port()
    out = Up("--port", str(free_port()), "--model", str(path), "--served-model-name", NAME,
             "--kv-store", "memory://", "--num-blocks", "128", "--dtype", "float32",
             "--expert-parallel", "2", "--redundant-experts", "2", "--eplb-interval", "3",
             "--metrics-port", str(metrics))  # fmt: skip
    try:
        client = openai.OpenAI(base_url=out.ready(), api_key="none", max_retries=0)
        args = {"model": NAME, "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                "extra_body": {"ignore_eos": True}}  # fmt: skip
        assert client.completions.create(**args).choices[0].text == expected
        shown = httpx.get(f"http://127.0.0.1:{metrics}/experts").json()
        group = shown["parallel"]
        assert group["rebalances"] >= 1 and group["ranks"] == 2  # moved while streaming
        assert shown["data_parallel"]["empty_passes"] == 0  # rank 0 has every request
        scraped = {  # no pass ran since /experts: the same figures
            (m.name, tuple(sorted(s.labels.items()))): s.value  # counters without _total
            for m in text_string_to_metric_families(
                httpx.get(f"http://127.0.0.1:{metrics}/metrics").text
            )
            for s in m.samples
        }
        for layer, per_rank in group["rank_tokens"].items():
            for rank, rows in enumerate(per_rank):
                labels = (("layer", layer), ("rank", str(rank)), ("role", "decode"))
                assert scraped["pdserve_moe_rank_tokens", labels] == rows
        assert scraped["pdserve_moe_rebalances", (("role", "decode"),)] == group["rebalances"]
        assert scraped["pdserve_moe_imbalance", (("role", "decode"),)] == group["imbalance"]

        pid = int(out.wait_for(r"pdserve: decode-0 started \(pid (\d+)\)", 5).group(1))
        (rank,) = [p for p in psutil.Process(pid).children() if "expert_rank" in p.cmdline()[2]]
        mark = len(out.lines)
        kill = lambda: rank.send_signal(signal.SIGKILL)  # noqa: E731  (mid-stream: rank 1)
        text, finishes = stream_completion(client, args, 5, kill)
        out.wait_for(r"pdserve: decode-0 exited with code 1; restarting", 10, mark)
        assert text == expected and finishes == ["length"]  # migrated to the restarted worker
        assert client.completions.create(**args).choices[0].text == expected
    finally:
        out.stop()
    assert not any(p.is_running() and p.status() != "zombie" for p in [rank])
