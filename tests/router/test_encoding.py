"""Which encoder an image goes to (router/workers/encoding.py): the same image always to the
same one, whatever else is sent; images spread over the encoders; an encoder gone moves only
its own images."""

from __future__ import annotations

from types import SimpleNamespace

from router.workers.encoding import pick


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
