"""Which encoder an image goes to (router/workers/encoding.py): the same image always to the
same one, whatever else is sent; images spread over the encoders; an encoder gone moves only
its own images. The prompt goes to its prefill worker while the encoders work."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from router.errors import APIError, bad_request
from router.workers.encoding import beside, pick
from services.rpc import worker_pb2 as pb


def encoders(*ports: int) -> list:
    return [SimpleNamespace(address=f"127.0.0.1:{p}") for p in ports]


def test_an_image_picks_one_encoder_and_only_its_own_move_when_one_goes():
    three = encoders(1, 2, 3)
    images = [bytes([i]) * 50 for i in range(60)]
    chosen = [pick(image, three).address for image in images]
    assert chosen == [pick(image, list(reversed(three))).address for image in images]
    counts = {w.address: chosen.count(w.address) for w in three}
    assert min(counts.values()) >= 10, counts  # spread, not all on one
    two = [w for w in three if w.address != "127.0.0.1:2"]
    moved = [pick(image, two).address for image in images]
    for before, after in zip(chosen, moved, strict=True):
        assert after == before or before == "127.0.0.1:2"


def test_the_prompt_is_sent_while_the_encoders_work_and_again_where_they_fail():
    """`beside`: the prefill goes at once with the images marked as being encoded; its
    reply is the answer when the encoders stored every image (or it came first); where
    they did not, it is called off and the prompt goes again, as files alone, under a
    request id of its own; an encoder's 400 calls the prefill off and is the answer."""
    waiting = [pb.Image(data=b"x", wait_ms=500)]

    async def case(encoded: bool | Exception, encode_after: float, prefill_after: float):
        calls: list[tuple[str, list | None]] = []
        cancelled: list[str] = []

        async def encode() -> bool:
            await asyncio.sleep(encode_after)
            if isinstance(encoded, Exception):
                raise encoded
            return encoded

        async def prefill(rid: str, images: list | None) -> str:
            calls.append((rid, images))
            try:
                await asyncio.sleep(prefill_after)
            except asyncio.CancelledError:
                cancelled.append(rid)
                raise
            return f"reply to {rid}"

        try:
            got: object = await beside(asyncio.ensure_future(encode()), prefill, "r", waiting)
        except APIError as e:
            got = e.status
        return got, calls, cancelled

    stored = asyncio.run(case(True, 0.05, 0.2))
    assert stored == ("reply to r", [("r", waiting)], [])
    first = asyncio.run(case(True, 0.5, 0.05))
    assert first == ("reply to r", [("r", waiting)], [])
    failed = asyncio.run(case(False, 0.05, 0.2))
    again = "r-encoding-failed"
    assert failed == (f"reply to {again}", [("r", waiting), (again, None)], ["r"])
    refused = asyncio.run(case(bad_request("not an image", "messages"), 0.05, 0.2))
    assert refused == (400, [("r", waiting)], ["r"])
