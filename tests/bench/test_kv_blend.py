"""The reference of approximate KV reuse (bench/kv_blend.py) on the embedded model: its dense
forward is transformers' model (logits within 1e-4); keys re-rotated from one position to
another are the keys rotated there; a chunk's cache reused where it was computed, after the
same text, is the exact cache; recomputing every token (ratio 1) gives full recomputation's
logits, and a ratio recomputes that many of the reused tokens and each chunk's first."""

from __future__ import annotations

import pytest
import torch
import transformers

from bench.kv_blend import Dense, Reused
from services.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def dense(embedded_dir) -> Dense:
    return Dense(embedded_dir)


@pytest.fixture(scope="module")
def pieces(embedded_dir) -> tuple[list[int], list[int], list[int], list[int]]:
    """A head, two chunks and a question, tokenized apart."""
    tok = Tokenizer.from_dir(embedded_dir)
    texts = (
        "You answer questions about the two notes below.\n",
        "The first note says that the lighthouse keeper paints the door blue every May.\n",
        "The second note says that the ferry leaves at nine and returns at six.\n",
        "When does the ferry return?",
    )
    a, b, c, d = (tok.encode(t, add_special_tokens=False) for t in texts)
    return a, b, c, d


def test_the_dense_forward_is_transformers_model(dense, embedded_dir, pieces):
    ids = [t for piece in pieces for t in piece]
    model = transformers.LlamaForCausalLM.from_pretrained(str(embedded_dir)).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0]
    _, ours = dense.extend(None, ids)
    assert (ours - theirs).abs().max() <= 1e-4


def test_keys_turned_to_another_position_are_the_keys_rotated_there(dense):
    x = torch.randn(5, 3, 64)
    at, to = torch.arange(7, 12), torch.arange(300, 305)
    turned = dense.rotate(dense.rotate(x, at), to - at)
    assert (turned - dense.rotate(x, to)).abs().max() <= 1e-5


def test_a_chunk_reused_where_it_was_computed_is_exact(dense, pieces):
    head, first, second, question = pieces
    ids = head + first + second + question
    whole, logits = dense.extend(None, ids)
    start, end = len(head) + len(first), len(head) + len(first) + len(second)
    reused = [Reused(start, whole.slice(start, end), start)]
    for ratio in (0.0, 0.3):
        cache, last, recomputed = dense.blend(ids, reused, ratio)
        assert (last - logits[-1]).abs().max() <= 1e-4
        assert (cache.values[20] - whole.values[20]).abs().max() <= 1e-4
        assert recomputed == 1 + round(ratio * len(second))


def test_every_token_recomputed_is_full_recomputation(dense, pieces):
    """The chunks' caches computed after other text (the second before the first): placed
    and all recomputed, the logits are full recomputation's; none recomputed, they are not."""
    head, first, second, question = pieces
    other = head[:3]
    caches = []
    for chunk in (second, first):
        cache, _ = dense.extend(None, other + chunk)
        caches.append(cache.slice(len(other), len(other) + len(chunk)))
    ids = head + first + second + question
    _, logits = dense.extend(None, ids)
    reused = [Reused(len(head), caches[1], len(other)),
              Reused(len(head) + len(first), caches[0], len(other))]  # fmt: skip
    _, last, recomputed = dense.blend(ids, reused, 1.0)
    assert recomputed == len(first) + len(second)
    assert (last - logits[-1]).abs().max() <= 1e-4
    _, plain, recomputed = dense.blend(ids, reused, 0.0)
    assert recomputed == 2  # each chunk's first token
    assert (plain - logits[-1]).abs().max() > 1e-2
