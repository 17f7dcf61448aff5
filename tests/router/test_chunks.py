"""The chunks a request marks for approximate KV reuse (router/completions/chunks.py) and how
KV-aware routing counts a worker's approximate hits apart from its exact ones
(router/workers/policy.py)."""

from __future__ import annotations

from router.completions.chunks import message_spans, separated
from router.completions.protocol import ChatMessage
from router.workers.jobs import Job
from router.workers.policy import Policy
from router.workers.registry import WorkerState
from services.rpc import worker_pb2 as pb
from services.settings import RouterSettings

DOC = "The ferry from Bellmoor leaves at nine in the morning and returns at six."


def test_a_message_is_the_same_chunk_wherever_it_stands(embedded):
    tok = embedded.tokenizer
    alone = tok.encode(DOC, add_special_tokens=False)
    for system in ("Answer briefly.", "You read archives of small towns, then answer."):
        messages = [ChatMessage(role="system", content=system),
                    ChatMessage(role="user", content=DOC),
                    ChatMessage(role="user", content="When does it return?")]  # fmt: skip
        text = tok.render_chat([m.as_template_input() for m in messages], True)
        spans = message_spans(text, messages)
        assert [text[a:b] for a, b in spans] == [system, DOC, "When does it return?"]
        ids, chunks = tok.encode_marked(text, spans, add_special_tokens=False)
        assert ids == tok.encode(text, add_special_tokens=False)
        a, b = chunks[1]
        assert ids[a:b] == alone


def test_a_separator_cuts_a_completion_prompt_into_pieces():
    assert separated("a\n\nbb\n\n\n\nc", "\n\n") == [(0, 1), (3, 5), (9, 10)]
    assert separated("no separator here", "\n\n") == [(0, 17)]
    assert separated("anything", None) == []


def worker(address: str) -> WorkerState:
    return WorkerState("prefill", address, channel=None, stub=None, healthy=True)  # type: ignore[arg-type]


def test_kv_aware_routing_counts_approximate_hits_after_exact_ones():
    policy = Policy(RouterSettings(policy="kv_aware"))
    a, b, c = worker("a:1"), worker("b:1"), worker("c:1")
    job = Job("r", list(range(100)), pb.SamplingParams(), 1, kv_reuse="approximate",
              chunks=((10, 40), (50, 90)))  # fmt: skip
    assert [t for _, t in job.reuse_chunks] == [30, 40]
    assert Job("r", job.prompt_ids, job.params, 1, chunks=job.chunks).reuse_chunks == ()
    b.remember([], job.reuse_chunks[:1])
    c.remember([], job.reuse_chunks)
    assert (b.cached_chunk_tokens(job.reuse_chunks), c.cached_chunk_tokens(job.reuse_chunks)) == (
        30,
        70,
    )
    assert policy.pick([a, b, c], [b"h0"], job.reuse_chunks) is c
    a.remember([b"h0"])  # an exact prefix counts first
    assert policy.pick([a, b, c], [b"h0"], job.reuse_chunks) is a
    assert policy.pick([b, c], [b"h0"], ()) in (b, c)  # no hit: the least loaded
