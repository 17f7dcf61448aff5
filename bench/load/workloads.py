"""Workloads: what the load client sends. Nothing is downloaded: prompts are built from the
model's tokenizer, or read from files given by path.

Every workload is a list of conversations; single-turn workloads have one turn each. A turn
is the user's text and the tokens to generate for it; later turns of a conversation carry the
earlier turns and the answers the server actually gave (multi-turn).

Prompt text is made of "words": tokens that decode to a space and letters and encode back to
themselves alone. Words never merge across the space before them, so a prompt of n words is
exactly n tokens; token counts in the results are exact.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

WORKLOADS = ("random", "shared-prefix", "multi-turn", "sharegpt", "trace", "random-mm", "rag")
SEPARATOR = "\n\n"  # rag over completions: between documents (the request's chunk_separator)


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class Turn:
    user: str
    output_tokens: int
    input_tokens: int = 0  # of `user` alone (completions prompts: of the whole prompt)
    images: list[str] = field(default_factory=list)  # data: URLs, sent before the text
    # rag: documents sent before the text, a message each (chat) or apart by SEPARATOR
    documents: list[str] = field(default_factory=list)


@dataclass
class Conversation:
    turns: list[Turn]
    system: str | None = None
    arrival: float | None = None  # trace: seconds after the run starts; else the load shape's
    answers: list[str] = field(default_factory=list)  # filled in as the server answers


@dataclass(frozen=True)
class WorkloadConfig:
    name: str = "random"
    num_prompts: int = 100
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0  # lengths uniform in [len * (1 - r), len * (1 + r)]
    prefix_len: int = 512  # shared-prefix: tokens of each group's system prompt
    groups: int = 8  # shared-prefix: groups of prompts sharing one
    turns: int = 4  # multi-turn
    dataset_path: Path | None = None  # sharegpt (JSON) or trace (JSONL)
    trace_block_size: int = 512  # trace: tokens per hash id (Mooncake's blocks)
    seed: int = 0
    # random-mm: images per request, their sizes (one drawn per image), and the share of
    # images repeated from earlier requests (the encoder cache's hits)
    images_per_request: int = 1
    image_sizes: tuple[tuple[int, int], ...] = ((224, 224),)
    image_repeat: float = 0.0
    # rag: a pool of `documents` documents of `document_len` tokens; each request draws
    # `documents_per_request` of them in a shuffled order, then asks `input_len` tokens
    documents: int = 16
    document_len: int = 500
    documents_per_request: int = 4


class Words:
    """The tokenizer's single-token words: text of exactly n tokens on demand."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        ids = []
        for i in range(tokenizer.vocab_size):
            text = tokenizer.decode([i])
            if len(text) > 2 and text[0] == " " and text[1:].isalpha() and text[1:].isascii():
                ids.append(i)
        self.ids = [i for i in ids if tokenizer.encode(tokenizer.decode([i]), False) == [i]]
        if len(self.ids) < 100:
            raise ValueError("the tokenizer has too few single-token words to build prompts")

    def text(self, n: int, rng: random.Random) -> str:
        return self.tokenizer.decode([rng.choice(self.ids) for _ in range(n)])

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, False))


def _length(mean: int, ratio: float, rng: random.Random) -> int:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(low, high)


def build(config: WorkloadConfig, tokenizer: Tokenizer) -> list[Conversation]:
    rng = random.Random(config.seed)
    if config.name == "sharegpt":
        return _sharegpt(config, tokenizer)
    words = Words(tokenizer)
    if config.name == "trace":
        return _trace(config, words)
    if config.name == "rag":
        return _rag(config, words, rng)
    conversations = []
    prefixes = [words.text(config.prefix_len, rng) for _ in range(config.groups)]
    for i in range(config.num_prompts):
        turns = []
        for _ in range(config.turns if config.name == "multi-turn" else 1):
            n = _length(config.input_len, config.range_ratio, rng)
            out = _length(config.output_len, config.range_ratio, rng)
            turns.append(Turn(words.text(n, rng), out, n))
        system = prefixes[i % config.groups] if config.name == "shared-prefix" else None
        if config.name not in ("random", "shared-prefix", "multi-turn", "random-mm"):
            raise ValueError(f"unknown workload {config.name!r} (choose {', '.join(WORKLOADS)})")
        conversations.append(Conversation(turns, system))
    if config.name == "random-mm":
        _add_images(conversations, config, rng)
    return conversations


def _rag(config: WorkloadConfig, words: Words, rng: random.Random) -> list[Conversation]:
    """Retrieval-augmented prompts: documents drawn from a pool, shuffled per request (what
    approximate KV reuse serves: the same documents at other positions), then a question."""
    if not 0 < config.documents_per_request <= config.documents:
        raise ValueError("rag: documents per request must be between 1 and the pool's size")
    pool = [words.text(config.document_len, rng) for _ in range(config.documents)]
    out = []
    for _ in range(config.num_prompts):
        docs = rng.sample(pool, config.documents_per_request)
        n = _length(config.input_len, config.range_ratio, rng)
        out_len = _length(config.output_len, config.range_ratio, rng)
        inputs = n + config.document_len * len(docs)
        out.append(Conversation([Turn(words.text(n, rng), out_len, inputs, documents=docs)]))
    return out


def _add_images(
    conversations: list[Conversation], config: WorkloadConfig, rng: random.Random
) -> None:
    """random-mm (as vLLM's random-mm dataset): each request's images of random pixels, each
    of one of the sizes; a share `image_repeat` of them an earlier request's image again."""
    made: list[str] = []
    for c in conversations:
        for turn in c.turns:
            for _ in range(config.images_per_request):
                if made and rng.random() < config.image_repeat:
                    turn.images.append(rng.choice(made))
                    continue
                width, height = rng.choice(config.image_sizes)
                made.append(random_image(width, height, rng))
                turn.images.append(made[-1])


def random_image(width: int, height: int, rng: random.Random) -> str:
    """A PNG of random pixels as a data: URL."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(rng.getrandbits(32)).integers(0, 256, (height, width, 3))
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _sharegpt(config: WorkloadConfig, tokenizer: Tokenizer) -> list[Conversation]:
    """The first human turn of each ShareGPT conversation; the reply's length as the output
    length. Pairs too short (< 4 tokens) or too long (prompt > 1024, both > 2048) are left
    out, as vLLM's benchmark does."""
    if config.dataset_path is None:
        raise ValueError("the sharegpt workload needs --dataset-path FILE.json")
    data = json.loads(Path(config.dataset_path).read_text())
    rng = random.Random(config.seed)
    rng.shuffle(data)
    out = []
    for item in data:
        turns = item.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human":
            continue
        prompt, reply = turns[0]["value"], turns[1]["value"]
        n = len(tokenizer.encode(prompt, False))
        m = len(tokenizer.encode(reply, False))
        if n < 4 or m < 4 or n > 1024 or n + m > 2048:
            continue
        out.append(Conversation([Turn(prompt, m, n)]))
        if len(out) == config.num_prompts:
            break
    return out


def _trace(config: WorkloadConfig, words: Words) -> list[Conversation]:
    """A Mooncake-style JSONL trace: `timestamp` (ms), `input_length`, `output_length`, and
    optionally `hash_ids` (one per `trace_block_size` tokens; equal ids are equal text, so
    prompts share prefixes as the traced ones did). Replayed at its own times."""
    if config.dataset_path is None:
        raise ValueError("the trace workload needs --dataset-path FILE.jsonl")
    rows = [
        json.loads(line)
        for line in Path(config.dataset_path).read_text().splitlines()
        if line.strip()
    ]
    start = min(row["timestamp"] for row in rows) if rows else 0
    blocks: dict[int, str] = {}
    out: list[Conversation] = []
    for row in rows[: config.num_prompts] if config.num_prompts else rows:
        n = int(row["input_length"])
        parts = []
        for h in row.get("hash_ids") or []:
            if h not in blocks:
                blocks[h] = words.text(config.trace_block_size, random.Random(f"block-{h}"))
            parts.append(blocks[h])
        text = "".join(parts)
        ids = words.tokenizer.encode(text, False)[:n] if text else []
        if len(ids) < n:
            rng = random.Random(f"rest-{len(out)}-{config.seed}")
            ids += words.tokenizer.encode(words.text(n - len(ids), rng), False)
        prompt = words.tokenizer.decode(ids)
        turn = Turn(prompt, int(row["output_length"]), n)
        out.append(Conversation([turn], arrival=(row["timestamp"] - start) / 1000))
    return out


def turns_in(conversations: list[Conversation]) -> Iterator[tuple[Conversation, int]]:
    for c in conversations:
        for i in range(len(c.turns)):
            yield c, i
