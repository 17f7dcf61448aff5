"""/metrics parses with prometheus_client's own parser, and its counters are the requests
sent and the tokens their usage reported."""

from __future__ import annotations

import httpx
import openai

from services.launcher import RouterProcess
from tests.support.cluster import MODEL, addresses, metrics

COMPLETIONS = (("endpoint", "/v1/completions"), ("status", "200"))


def test_metrics_count_what_was_sent(pool, tmp_path):
    prefill, decode = pool
    router = RouterProcess(tmp_path, addresses(prefill), addresses(decode)).start()
    try:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
        prompt_tokens = completion_tokens = 0
        for i in range(3):
            r = client.completions.create(model=MODEL, prompt=f"Count to {i + 3}:", max_tokens=6)
            prompt_tokens += r.usage.prompt_tokens
            completion_tokens += r.usage.completion_tokens
        for i in range(2):
            stream = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Say {i}"}],
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
            (usage,) = [c.usage for c in stream if c.usage is not None]
            prompt_tokens += usage.prompt_tokens
            completion_tokens += usage.completion_tokens
        assert httpx.post(f"{router.url}/v1/completions", json={"prompt": 1}).status_code == 400
        for path in ("/wp-admin", "/.env"):  # unknown paths: one label, OpenAI's error shape
            response = httpx.get(f"{router.url}{path}")
            assert response.status_code == 404
            assert response.json()["error"]["message"] == "Not Found"

        values = metrics(router.url)
        assert values[("pdserve_requests_total", COMPLETIONS)] == 3
        chat = (("endpoint", "/v1/chat/completions"), ("status", "200"))
        assert values[("pdserve_requests_total", chat)] == 2
        bad = (("endpoint", "/v1/completions"), ("status", "400"))
        assert values[("pdserve_requests_total", bad)] == 1
        assert values[("pdserve_requests_total", (("endpoint", "other"), ("status", "404")))] == 2
        assert values[("pdserve_prompt_tokens_total", ())] == prompt_tokens
        assert values[("pdserve_generation_tokens_total", ())] == completion_tokens
        for name in ("time_to_first_token", "e2e_request_latency"):
            assert values[(f"pdserve_{name}_seconds_count", ())] == 5
        # a gap between every two tokens of a request
        assert values[("pdserve_inter_token_latency_seconds_count", ())] == completion_tokens - 5
        assert values[("pdserve_requests_running", ())] == 0
        assert values[("pdserve_requests_waiting", ())] == 0
        for w in (*prefill, *decode):
            assert (
                values[("pdserve_worker_healthy", (("role", w.role), ("worker", w.address)))] == 1
            )
        assert 0 <= values[("pdserve_prefix_cache_hit_ratio", ())] <= 1
    finally:
        router.stop()
