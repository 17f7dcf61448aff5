"""Every error the router answers, in OpenAI's shape; API keys, per-key cache isolation and the
admin API; and a router that survives a stream of bad requests."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from services.launcher import RouterProcess
from tests.support.cluster import MODEL, addresses, metrics, wait_until

GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**GOOD, "temperature": "hot"}, "temperature"),
        ({**GOOD, "temperature": -0.5}, "temperature"),
        ({**GOOD, "top_p": 0}, "top_p"),
        ({**GOOD, "top_k": -2}, "top_k"),
        ({**GOOD, "n": 0}, "n"),
        ({**GOOD, "logprobs": 21}, "logprobs"),
        ({**GOOD, "max_tokens": 0}, "max_tokens"),
        ({**GOOD, "prompt": 5}, "prompt"),
        ({**GOOD, "prompt": [5, 10**9]}, "prompt"),  # outside the vocabulary
        ({**GOOD, "prompt": list(range(100, 8300))}, "prompt"),  # past the context window
        ({**GOOD, "logit_bias": {"x": 1}}, "logit_bias"),
        ({**GOOD, "top_k": 49153}, "top_k"),  # larger than the vocabulary
        ({**GOOD, "top_k": 3_000_000_000}, "top_k"),  # past the wire's int32
        ({**GOOD, "stream": "yes"}, "stream"),  # types are strict: no coercion
        ({**GOOD, "max_tokens": "5"}, "max_tokens"),
        ({**GOOD, "max_tokens": 2.5}, "max_tokens"),
        ({**GOOD, "echo": 1}, "echo"),
        ({**GOOD, "n": 17}, "n"),  # past --max-n
        ({**GOOD, "prompt": ["a"] * 65}, "prompt"),  # past --max-prompts
        ({**GOOD, "prompt": ["a"] * 64, "n": 16}, "n"),  # 1,024 sequences > --max-pending
        ({"model": MODEL, "max_tokens": 2}, "prompt"),  # missing
    ],
)
def test_bad_completion_fields_are_400_naming_the_field(router, body, param):
    error = error_of(httpx.post(f"{router.url}/v1/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param or error["param"].startswith(param + ".")


def test_bad_chat_fields_are_400(router):
    url = f"{router.url}/v1/chat/completions"
    message = [{"role": "user", "content": "hi"}]
    assert error_of(httpx.post(url, json={"messages": []}), 400)["param"] == "messages"
    bad_role = {"messages": [{"role": "wizard", "content": "hi"}]}
    assert error_of(httpx.post(url, json=bad_role), 400)["param"].startswith("messages")
    lonely = {"messages": message, "top_logprobs": 2}
    assert error_of(httpx.post(url, json=lonely), 400)["param"] == "top_logprobs"


def test_malformed_json_and_non_objects_are_400(router):
    url = f"{router.url}/v1/completions"
    headers = {"content-type": "application/json"}
    for raw in (b"{bad json", b"[1, 2]", b"\xff\xfe", b""):
        error = error_of(httpx.post(url, content=raw, headers=headers), 400)
        assert error["type"] == "invalid_request_error"


def test_lone_surrogates_are_400_wherever_they_are(router):
    headers = {"content-type": "application/json"}
    cases = [
        ("/v1/completions", b'{"prompt": "hi \\ud800 there", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt.1"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages.0.content",
        ),
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
        ("/v1/completions", b'{"prompt": "x", "stop": ["\\udbff"], "max_tokens": 2}', "stop.0"),
    ]
    for path, raw, param in cases:
        error = error_of(httpx.post(f"{router.url}{path}", content=raw, headers=headers), 400)
        assert error["param"] == param and "surrogate" in error["message"]
    pair = b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}'  # a whole pair is an emoji: fine
    assert httpx.post(f"{router.url}/v1/completions", content=pair, headers=headers).is_success


@pytest.mark.parametrize("depth", [1500, 900])
def test_deeply_nested_json_is_400(router, depth):
    raw = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    response = httpx.post(
        f"{router.url}/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert error_of(response, 400)["type"] == "invalid_request_error"


def test_unknown_model_is_404(router, client):
    error = error_of(
        httpx.post(f"{router.url}/v1/completions", json={**GOOD, "model": "gpt-9"}), 404
    )
    assert error["code"] == "model_not_found" and error["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])


def test_oversized_body_is_413(router):
    body = json.dumps({**GOOD, "prompt": "a " * (17 << 20)}).encode()  # 34 MiB > 32 MiB
    response = httpx.post(
        f"{router.url}/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert error_of(response, 413)["code"] == "request_too_large"


def test_fifty_malformed_requests_then_a_valid_one(router, client):
    url = f"{router.url}/v1/completions"
    bad = [b"{", b"null", b'{"prompt": {}}', b'{"model": 1}', b'{"max_tokens": "x"}']
    with httpx.Client() as http:
        for i in range(50):
            response = http.post(
                url, content=bad[i % len(bad)], headers={"content-type": "application/json"}
            )
            assert response.status_code == 400
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


def test_api_keys_and_per_key_cache_isolation(pool, tmp_path):
    prefill, decode = pool
    router = RouterProcess(
        tmp_path, addresses(prefill), addresses(decode), "--api-keys", "key-a,key-b"
    ).start()
    try:
        url = f"{router.url}/v1/completions"
        assert error_of(httpx.post(url, json=GOOD), 401)["code"] == "invalid_api_key"
        wrong = {"Authorization": "Bearer nope"}
        assert error_of(httpx.post(url, json=GOOD, headers=wrong), 401)["code"] == "invalid_api_key"
        assert httpx.get(f"{router.url}/health").status_code == 200  # probes need no key
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{router.url}/v1", api_key="nope").models.list()

        prompt = "Tenant secrets: " + " ".join(f"item{i}" for i in range(60))

        def cached(key: str) -> int:
            client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=key, max_retries=0)
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
            return r.usage.prompt_tokens_details.cached_tokens

        assert cached("key-a") == 0
        assert cached("key-a") >= 16 * 4  # its own blocks, cached (locally or in the store)
        assert cached("key-b") == 0  # another tenant's identical prompt finds nothing
    finally:
        router.stop()


def test_no_workers_waits_retry_wait_then_503_and_admin_api_adds_them(pool, tmp_path):
    """With no worker of a role available, a request waits up to --retry-wait for one
    (counted in a gauge), answered once one comes (here: added), else 503 + Retry-After."""
    prefill, decode = pool
    router = RouterProcess(tmp_path, [], [], "--admin-key", "root", "--retry-wait", "3").start(
        healthy=False
    )
    try:
        assert error_of(httpx.get(f"{router.url}/health"), 503)
        start = time.monotonic()
        response = httpx.post(f"{router.url}/v1/completions", json=GOOD, timeout=30)
        assert time.monotonic() - start >= 3  # waited for a worker to come back
        assert "waited 3s" in error_of(response, 503)["message"]
        assert response.headers["retry-after"] == "1"
        admin = f"{router.url}/admin/workers"
        change = {"role": "prefill", "address": prefill[0].address}
        assert error_of(httpx.post(admin, json=change), 401)
        root = {"Authorization": "Bearer root"}
        added = httpx.post(admin, json=change, headers=root).json()
        assert added == {**change, "healthy": True}
        waiting: list[httpx.Response] = []
        asked = threading.Thread(
            target=lambda: waiting.append(
                httpx.post(f"{router.url}/v1/completions", json=GOOD, timeout=30)
            )
        )
        asked.start()  # no decode worker yet: it waits
        gauge = ("pdserve_requests_waiting_for_worker", ())
        wait_until(lambda: metrics(router.url).get(gauge) == 1, timeout=5)
        change = {"role": "decode", "address": decode[0].address}
        assert httpx.post(admin, json=change, headers=root).json()["healthy"] is True
        asked.join()
        assert waiting[0].status_code == 200 and metrics(router.url)[gauge] == 0
        assert httpx.get(f"{router.url}/health").status_code == 200
        assert httpx.post(f"{router.url}/v1/completions", json=GOOD).status_code == 200
        assert httpx.request("DELETE", admin, json=change, headers=root).status_code == 200
        assert httpx.get(f"{router.url}/health").status_code == 503
        assert error_of(httpx.request("DELETE", admin, json=change, headers=root), 404)
    finally:
        router.stop()


def test_too_much_waiting_work_is_429_with_retry_after(pool, tmp_path):
    prefill, decode = pool
    router = RouterProcess(
        tmp_path, addresses(prefill), addresses(decode), "--max-pending", "1"
    ).start()
    try:
        started = threading.Event()
        long = {**GOOD, "max_tokens": 60, "ignore_eos": True, "stream": True}

        def stream() -> None:
            with httpx.stream("POST", f"{router.url}/v1/completions", json=long) as response:
                for _ in response.iter_lines():
                    started.set()

        thread = threading.Thread(target=stream)
        thread.start()
        assert started.wait(30)
        response = httpx.post(f"{router.url}/v1/completions", json=GOOD, timeout=30)
        assert error_of(response, 429)["code"] == "rate_limit_exceeded"
        assert response.headers["retry-after"] == "1"
        thread.join()
        assert httpx.post(f"{router.url}/v1/completions", json=GOOD).status_code == 200
    finally:
        router.stop()


def test_an_unexpected_exception_is_a_500_in_openai_shape_logged_with_its_id(caplog):
    import logging
    import time

    import uvicorn

    from router.app import create_app
    from services.launcher import free_port
    from services.settings import Settings

    app = create_app(Settings(role="router"))

    def broken(*args, **kwargs):
        raise RuntimeError("tokenizer bug")

    app.state.router.tokenizer.encode = broken  # a bug anywhere below a handler
    server = uvicorn.Server(uvicorn.Config(app, port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        url = f"http://127.0.0.1:{server.config.port}/tokenize"
        with caplog.at_level(logging.ERROR, logger="pdserve.router"):
            response = httpx.post(url, json={"prompt": "hello"})
        error = error_of(response, 500)
        assert error["type"] == "server_error" and error["code"] == "internal_error"
        rid = response.headers["x-request-id"]
        assert rid in error["message"]
        record = next(r for r in caplog.records if r.getMessage() == "unhandled error")
        assert record.fields["request_id"] == rid and "tokenizer bug" in caplog.text
        assert httpx.get(f"http://127.0.0.1:{server.config.port}/version").status_code == 200
    finally:
        server.should_exit = True
        thread.join(10)
