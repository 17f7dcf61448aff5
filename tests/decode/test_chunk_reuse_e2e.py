"""Approximate KV reuse through the service (issue 55): redis, a prefill worker, a decode
worker and the router, the official openai client, in every dtype the CPU runs.

A chat whose documents another chat read in another order, after another system prompt, asks
for `kv_reuse: approximate`: its usage says how many prompt tokens were placed (every token
of the two documents, as the tokenizer makes them alone) and how many computed again (each
document's first and 30% of the rest), and its text and logprobs are those of one engine in
the same dtype taking the same two prompts with the same chunks. Two prefill workers take
the chats in turn: the second never computed the documents and reads them from the store,
where the first put them; the decode worker computes the prompt over the chunks it kept
reading the first chat's blocks (the same bits everywhere). Asked exactly afterwards,
the same chat gets full computation's answer, no approximate usage: nothing approximate was
stored under its prefix. The router's metrics count the approximate hits apart from exact
ones, and its console shows each worker's. `/v1/completions` marks chunks with
`chunk_separator`; a bad `kv_reuse` is a 400 naming it.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from router.completions.chunks import message_spans, separated
from router.completions.protocol import ChatMessage
from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.engine.request import EngineRequest
from services.launcher import RouterProcess, WorkerProcess
from services.model.loader import load_model
from services.settings import ReuseConfig
from tests.support.cluster import MODEL, addresses, metrics, wait_until
from tests.support.dtypes import COMPUTE_DTYPES
from tests.support.redis_servers import RedisServer

MAX_TOKENS = 12
DOCS = [
    "The first note says that the lighthouse keeper of Arden paints the old door blue every "
    "May, and that the key to the lamp room hangs behind the kitchen clock.",
    "The second note says that the ferry from Bellmoor leaves at nine in the morning, returns "
    "at six in the evening, and never sails when the harbour bell is silent.",
]
QUESTION = "When does the ferry return?"


def chat(system: str, docs: list[str]) -> list[dict[str, str]]:
    return [{"role": "system", "content": system},
            *({"role": "user", "content": d} for d in docs),
            {"role": "user", "content": QUESTION}]  # fmt: skip


FIRST = chat("You answer questions about the notes below.", DOCS)
MOVED = chat("Read every note, then answer the question briefly.", DOCS[::-1])


@pytest.fixture(scope="module", params=COMPUTE_DTYPES)
def stack(request, embedded_dir, tmp_path_factory):
    dtype = request.param
    logs = tmp_path_factory.mktemp(f"chunk-reuse-{dtype}")
    redis = RedisServer(logs / "redis").start()
    model, args = str(embedded_dir), ("--num-blocks", "200")
    workers = [WorkerProcess(r, model, redis.url, logs, *args, dtype=dtype)
               for r in ("prefill", "prefill", "decode")]  # fmt: skip
    try:
        for w in workers:
            w.launch()
        for w in workers:
            w.wait_ready()
        router = RouterProcess(logs, addresses(workers[:2]), addresses(workers[2:]),
                               "--served-model-name", MODEL, "--health-interval", "0.5",
                               "--policy", "round_robin", model=model)  # fmt: skip
        try:
            yield dtype, router.start()
        finally:
            router.stop()
    finally:
        for w in workers:
            w.stop()
        redis.stop()


def ask(client: openai.OpenAI, messages, kv_reuse: str):
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
        extra_body={"kv_reuse": kv_reuse, "ignore_eos": True},
    )  # fmt: skip
    choice = out.choices[0]
    logprobs = [t.logprob for t in choice.logprobs.content]
    return choice.message.content, logprobs, out.usage.prompt_tokens_details.model_dump()


def in_process(embedded_dir, dtype: str, kv_reuse: str) -> list[tuple[str, list[float]]]:
    """One engine taking the two chats' prompts and chunks as the router makes them."""
    loaded = load_model(str(embedded_dir), dtype=dtype, device="cpu")
    config = EngineConfig(num_blocks=200, reuse=ReuseConfig(kv_reuse=kv_reuse))
    engine = Engine(loaded.model, loaded.tokenizer, config)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    out = []
    for i, messages in enumerate((FIRST, MOVED)):
        text = loaded.tokenizer.render_chat(messages, True)
        spans = message_spans(text, [ChatMessage(**m) for m in messages])
        ids, chunks = loaded.tokenizer.encode_marked(text, spans, add_special_tokens=False)
        engine.add_request(EngineRequest(f"r{i}", ids, params, chunks=tuple(chunks)))
        seq = engine.requests[f"r{i}"].seqs[0]
        while engine.has_unfinished:
            engine.step()
        out.append((seq.text, [lp.logprob for lp in seq.logprobs]))
    return out


def test_a_moved_document_is_reused_approximately_and_said(stack, embedded_dir):
    dtype, router = stack
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
    first = ask(client, FIRST, "approximate")
    assert "approximate_tokens" not in first[2]  # nothing to reuse yet

    def stored() -> bool:  # written after the reply, off the request's path
        workers = httpx.get(f"{router.url}/console/stack").json()["workers"]
        return sum(w["chunks_stored"] for w in workers) >= 2

    assert wait_until(stored, 30)
    moved = ask(client, MOVED, "approximate")
    tok = load_model(str(embedded_dir), dtype="float32", device="cpu").tokenizer
    placed = sum(len(tok.encode(d, add_special_tokens=False)) for d in DOCS)
    assert moved[2]["approximate_tokens"] == placed
    assert moved[2]["recomputed_tokens"] == 2 + round(0.3 * placed)
    assert [first[:2], moved[:2]] == in_process(embedded_dir, dtype, "approximate")
    values = metrics(router.url)  # the router counts approximate hits apart from exact ones
    assert values[("pdserve_approximate_hit_tokens_total", ())] == placed
    assert values[("pdserve_approximate_recomputed_tokens_total", ())] == 2 + round(0.3 * placed)

    def console() -> list | None:
        # in turn: the first prefill worker computed the documents and stored them; the
        # second read them from the store and placed them; the decode worker placed those it
        # kept reading the first chat's blocks
        workers = httpx.get(f"{router.url}/console/stack").json()["workers"]
        seen = sorted((w["role"], w["approximate_tokens"], w["cached_chunks"],
                       w["chunks_from_store"]) for w in workers)  # fmt: skip
        want = [("decode", placed, 2, 0), ("prefill", 0, 2, 0), ("prefill", placed, 2, 2)]
        return seen if seen == want else None

    assert wait_until(console, 30)

    exact = ask(client, MOVED, "exact")
    assert "approximate_tokens" not in exact[2]
    assert exact[:2] == in_process(embedded_dir, dtype, "exact")[1]


def test_completions_mark_chunks_with_a_separator_and_bad_values_are_400s(stack):
    _, router = stack
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
    sep = "\n\n"
    for head, docs in (("Notes:", DOCS), ("Here are the notes:", DOCS[::-1])):
        prompt = sep.join([head, *docs, QUESTION])
        assert len(separated(prompt, sep)) == 4
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
            extra_body={"kv_reuse": "approximate", "chunk_separator": sep},
        )  # fmt: skip
    details = out.usage.prompt_tokens_details.model_dump()
    assert details["approximate_tokens"] > 0
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL, prompt="hi", max_tokens=1, extra_body={"kv_reuse": "fuzzy"}
        )
    assert e.value.body["param"] == "kv_reuse"
