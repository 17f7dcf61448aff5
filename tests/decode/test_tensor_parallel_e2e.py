"""`pdserve up --tensor-parallel 3` on the embedded model: each worker split over three
processes (its 3 KV heads one each), prefill's blocks gathered whole into the store and split
again by decode, answer as one process does, token for token with the same logprobs, through
the router and the official client; a rank killed mid-stream takes its worker out of service
(exit code 1, restarted by `up`) and the stream completes on the restarted worker; nothing
hangs."""

from __future__ import annotations

import signal

import openai
import psutil

from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.launcher import free_port
from tests.support.up import Up, stream_completion

PROMPT = "The lighthouse keeper climbed the stairs and"
NAME = "SmolLM2-135M-Instruct"


def test_split_workers_answer_as_one_process_and_a_dead_rank_restarts_its_worker(embedded):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    engine = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=128))
    (expected,) = engine.generate([PROMPT], params)
    out = Up("--port", str(free_port()), "--kv-store", "memory://", "--num-blocks", "128",
             "--dtype", "float32", "--tensor-parallel", "3")  # fmt: skip
    try:
        client = openai.OpenAI(base_url=out.ready(), api_key="none", max_retries=0)
        args = {"model": NAME, "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                "logprobs": 2, "extra_body": {"ignore_eos": True}}  # fmt: skip
        choice = client.completions.create(**args).choices[0]
        assert choice.text == expected.choices[0].text
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        want = [lp.logprob for lp in expected.choices[0].logprobs]
        assert choice.logprobs.token_logprobs == want

        pid = int(out.wait_for(r"pdserve: decode-0 started \(pid (\d+)\)", 5).group(1))
        ranks = [p for p in psutil.Process(pid).children() if "parallel.ranks" in p.cmdline()[2]]
        assert len(ranks) == 2
        mark = len(out.lines)
        kill = lambda: ranks[1].send_signal(signal.SIGKILL)  # noqa: E731  (mid-stream)
        text, finishes = stream_completion(client, args, 5, kill)
        out.wait_for(r"pdserve: decode-0 exited with code 1; restarting", 10, mark)
        assert text == expected.choices[0].text and finishes == ["length"]  # migrated
        assert client.completions.create(**args).choices[0].text == expected.choices[0].text
    finally:
        out.stop()
    assert not any(p.is_running() and p.status() != "zombie" for p in ranks)
