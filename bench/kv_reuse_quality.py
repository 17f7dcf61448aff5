"""How much approximate KV reuse changes the embedded model's answers (issue 55, item 4), on the
reference (bench/kv_blend.py), against full recomputation of the same prompts.

    python -m bench.kv_reuse_quality [--docs 2,4,8] [--prompts 3] [--words 330] [--json F]

Each prompt: a system prompt, `docs` documents in a shuffled order, a question whose answer (a
room number) is stated in one of them. Each document was computed once before, after another
system prompt (its first sighting: other text before it, other positions); here its cache is
placed at its new position, keys re-rotated, and `ratio` of its tokens recomputed from layer
1 on (CacheBlend's choice). Per ratio, against full recomputation:

- KL(full || reused) of the next-token distribution, mean over the first 16 positions of
  the full answer (both fed the full answer's tokens);
- greedy agreement: the 32-token answers' common prefix, and how many are equal whole;
- retrieval: how many answers contain the stated number (full recomputation's count beside).

The documents are made of seeded sentences about invented places (no data to download).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.kv_blend import Cache, Dense, Reused
from services.model.loading.sources import EMBEDDED, resolve
from services.tokenizer.tokenizer import Tokenizer

RATIOS = (0.0, 0.05, 0.15, 0.30)
ANSWER = 32  # tokens of each greedy answer
KL_POSITIONS = 16
WORDS = dict(
    place=["Arden", "Bellmoor", "Corvey", "Dunmere", "Eastholm", "Farrow", "Glenwick", "Halden",
           "Ironvale", "Juniper", "Kestrel", "Larkspur", "Millbrook", "Northgate", "Oakhurst"],
    thing=["lantern", "ledger", "compass", "banner", "clock", "map", "key", "bell", "crown",
           "mirror"],
    colour=["red", "blue", "green", "silver", "golden", "black", "white", "amber"],
    verb=["built", "repaired", "painted", "visited", "measured", "described", "guarded",
          "sold"],
    who=["the mayor", "a carpenter", "two students", "the old keeper", "a merchant",
         "the council", "a traveller", "the baker"],
)  # fmt: skip
SENTENCES = (
    "In {place}, {who} {verb} the {colour} {thing} near the river.",
    "The {thing} of {place} was {verb} by {who} during the long winter.",
    "Every spring {who} from {place} talks about the {colour} {thing}.",
    "Records say the {colour} {thing} in {place} was {verb} twice by {who}.",
    "Nobody in {place} remembers why {who} {verb} the {thing} at night.",
)


@dataclass
class Doc:
    text: str
    fact: str  # the room number stated in it
    question: str


def make_doc(rng: random.Random, words: int, index: int) -> Doc:
    place = WORDS["place"][index % len(WORDS["place"])]
    colour, thing = rng.choice(WORDS["colour"]), rng.choice(WORDS["thing"])
    room = str(rng.randint(100, 999))
    fact = f"The {colour} {thing} of {place} is kept in room {room}."
    sentences: list[str] = []
    while sum(len(s.split()) for s in sentences) < words:
        fill = {k: rng.choice(v) for k, v in WORDS.items()} | {"place": place}
        sentences.append(rng.choice(SENTENCES).format(**fill))
    sentences.insert(rng.randint(1, len(sentences) - 1), fact)
    text = f"Notes on {place}. " + " ".join(sentences)
    question = f"In which room is the {colour} {thing} of {place} kept?"
    return Doc(text, room, question)


@dataclass
class Scores:
    kl: list[float] = field(default_factory=list)
    common: list[int] = field(default_factory=list)
    equal: int = 0
    retrieved: int = 0
    recomputed: list[float] = field(default_factory=list)  # of the reused tokens


def greedy(model: Dense, cache: Cache, first: torch.Tensor, n: int) -> list[int]:
    tokens = [int(first.argmax())]
    for _ in range(n - 1):
        cache, logits = model.extend(cache, tokens[-1:])
        tokens.append(int(logits[-1].argmax()))
    return tokens


def forced(model: Dense, cache: Cache, first: torch.Tensor, answer: list[int]) -> torch.Tensor:
    """Log-probabilities [len(answer), vocab] of each next token, fed `answer`."""
    _, logits = model.extend(cache, answer[:-1])
    return torch.cat([first[None], logits]).log_softmax(-1)


def run(model: Dense, tok: Tokenizer, docs: int, prompts: int, words: int) -> dict:
    scores = {r: Scores() for r in RATIOS}
    full_retrieved = 0
    rng = random.Random(docs)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    for p in range(prompts):
        pool = [make_doc(rng, words, p * docs + i) for i in range(docs)]
        asked = rng.choice(pool)
        seen = encode("<|im_start|>system\nYou summarise local archives.<|im_end|>\n"
                      "<|im_start|>user\n")  # fmt: skip
        head = encode("<|im_start|>system\nAnswer from the documents below.<|im_end|>\n"
                      "<|im_start|>user\n")  # fmt: skip
        chunks = []
        for d in pool:  # each one's first sighting: after `seen`
            ids = encode(d.text + "\n\n")
            cache, _ = model.extend(None, seen + ids)
            chunks.append((ids, cache.slice(len(seen), len(seen) + len(ids))))
        rng.shuffle(chunks)
        tail = encode(f"Question: {asked.question}<|im_end|>\n<|im_start|>assistant\n")
        ids, reused = list(head), []
        for chunk_ids, cache in chunks:
            reused.append(Reused(len(ids), cache, len(seen)))
            ids += chunk_ids
        ids += tail
        full_cache, full_logits = model.extend(None, ids)
        full_answer = greedy(model, full_cache, full_logits[-1], ANSWER)
        full_lp = forced(model, full_cache, full_logits[-1], full_answer[:KL_POSITIONS])
        full_retrieved += asked.fact in tok.decode(full_answer)
        for ratio in RATIOS:
            cache, last, recomputed = model.blend(ids, reused, ratio)
            answer = greedy(model, cache, last, ANSWER)
            lp = forced(model, cache, last, full_answer[:KL_POSITIONS])
            s = scores[ratio]
            s.kl.append(float((full_lp.exp() * (full_lp - lp)).sum(-1).mean()))
            common = next((i for i, (a, b) in enumerate(zip(answer, full_answer, strict=True))
                           if a != b), ANSWER)  # fmt: skip
            s.common.append(common)
            s.equal += answer == full_answer
            s.retrieved += asked.fact in tok.decode(answer)
            s.recomputed.append(recomputed / sum(len(r.cache) for r in reused))
        print(f"docs {docs}, prompt {p + 1}/{prompts}: {len(ids)} tokens", flush=True)
    return {
        "docs": docs, "prompts": prompts, "tokens": len(ids), "full_retrieved": full_retrieved,
        "ratios": {str(r): {"kl": sum(s.kl) / len(s.kl), "common": sum(s.common) / len(s.common),
                            "equal": s.equal, "retrieved": s.retrieved,
                            "recomputed": sum(s.recomputed) / len(s.recomputed)}
                   for r, s in scores.items()},
    }  # fmt: skip


def table(results: list[dict]) -> str:
    rows = ["| documents (tokens) | recompute ratio | tokens recomputed | mean KL, 16 positions "
            "| common prefix of 32 | equal answers | fact retrieved (full recompute) |",
            "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in results:
        for ratio, s in r["ratios"].items():
            rows.append(
                f"| {r['docs']} ({r['tokens']}) | {float(ratio):.0%} | {s['recomputed']:.1%} | "
                f"{s['kl']:.4f} | {s['common']:.1f} | {s['equal']}/{r['prompts']} | "
                f"{s['retrieved']}/{r['prompts']} ({r['full_retrieved']}/{r['prompts']}) |"
            )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", default="2,4,8")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--words", type=int, default=330, help="words a document (~500 tokens)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.manual_seed(0)
    path = resolve(EMBEDDED)
    model, tok = Dense(path), Tokenizer.from_dir(path)
    started = time.perf_counter()
    results = [run(model, tok, int(d), args.prompts, args.words) for d in args.docs.split(",")]
    print(table(results))
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
