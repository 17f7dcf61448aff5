"""How far bfloat16 answers drift from float32: pdserve's and transformers' side by side.

    python -m bench.dtype_quality [--model embedded] [--dtype bfloat16] [--tokens 32] [--out FILE]

On a fixed set of chat questions (`QUESTIONS`), each system answers greedily in float32 and
in `--dtype`; the table says, for each system, against its own float32 answers: on how many
questions the greedy answer is the same over `--tokens` tokens, the mean common prefix of the
answers in tokens, and the mean KL divergence KL(float32 || dtype) of the first answer token's
distribution. pdserve runs its engine (the serving path: batched, paged, its kernels);
transformers runs `generate` on the same weights, one question at a time. A system whose
float32 answers differ from the other's is reported too (they should not: greedy parity).

An answer that parts from float32's where float32's own two best logits are within `TIE` of
each other is counted apart ("parted at a float32 tie"): at that margin the float32 answer is
a coin flip of its own rounding (a different summation order flips it), not something a
lower precision drifts from. On the AMX Xeon of 2026-12-07 one question ("What language is
spoken in Brazil?") has its first token's two best logits 0.00002 apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass

import torch

from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.model.batch import ForwardBatch, SeqChunk
from services.model.causal_lm import CausalLM
from services.model.loader import load_model
from services.model.loading.sources import resolve

QUESTIONS = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water at sea level?",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 12?",
    "Name three primary colors.",
    "What is the largest planet in the solar system?",
    "Give me a synonym for happy.",
    "What language is spoken in Brazil?",
    "Why is the sky blue?",
    "Write a haiku about autumn.",
    "What does a CPU do?",
    "How do I reverse a list in Python?",
    "What is the chemical symbol for gold?",
    "Suggest a name for a pet goldfish.",
)
BLOCK = 16
TIE = 1e-3  # logits: two best this close are float32's own coin flip


@dataclass(frozen=True)
class Answers:
    tokens: list[list[int]]  # per question, greedy
    first: torch.Tensor  # [questions, vocab] float32 logits of the first answer token


@dataclass(frozen=True)
class Drift:
    system: str
    same: int  # questions answered identically
    prefix: float  # mean common prefix, tokens
    kl: float  # mean KL(float32 || dtype) of the first token
    ties: int = 0  # questions whose answers part where float32's two best logits tie

    @property
    def decided_same(self) -> int:
        """Questions answered as float32 does wherever float32 decides."""
        return self.same + self.ties


def pdserve_answers(
    model_dir: str, dtype: str, prompts: list[list[int]], tokens: int, end: set[int]
) -> Answers:
    loaded = load_model(model_dir, dtype=dtype, device="cpu")
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=256))
    params = SamplingParams(max_tokens=tokens, temperature=0)
    outputs = engine.generate(prompts, params)
    answers = [_until_end(list(o.choices[0].token_ids), end) for o in outputs]
    return Answers(answers, torch.stack([_last_logits(loaded.model, p) for p in prompts]))


def _last_logits(model: CausalLM, ids: list[int]) -> torch.Tensor:
    kv = model.new_kv_cache(-(-len(ids) // BLOCK), BLOCK)
    batch = ForwardBatch.build([SeqChunk(ids, 0, list(range(kv.num_blocks)))], BLOCK)
    return model.forward(batch, kv)[0].float()


def transformers_answers(
    model_dir: str, dtype: str, prompts: list[list[int]], tokens: int, end: set[int]
) -> Answers:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)
    ).eval()
    answers, first = [], []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            first.append(model(x).logits[0, -1].float())
            out = model.generate(
                x, max_new_tokens=tokens, do_sample=False, attention_mask=torch.ones_like(x),
                pad_token_id=0,
            )  # fmt: skip
            answers.append(_until_end(out[0, len(ids) :].tolist(), end))
    return Answers(answers, torch.stack(first))


def drift(system: str, reference: Answers, other: Answers) -> Drift:
    prefixes = [_common_prefix(a, b) for a, b in zip(reference.tokens, other.tokens, strict=True)]
    p = reference.first.log_softmax(-1)
    q = other.first.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    return Drift(
        system,
        same=sum(a == b for a, b in zip(reference.tokens, other.tokens, strict=True)),
        prefix=sum(prefixes) / len(prefixes),
        kl=float(kl.mean()),
    )


def _until_end(tokens: list[int], end: set[int]) -> list[int]:
    """The answer's tokens before its first end token."""
    for n, t in enumerate(tokens):
        if t in end:
            return tokens[:n]
    return tokens


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def table(rows: list[Drift], dtype: str, questions: int, tokens: int) -> str:
    lines = [
        f"| system ({dtype} against its own float32) | same answer, of {questions} "
        f"({tokens} tokens) | parted at a float32 tie | mean common prefix (tokens) | "
        "mean KL, first token |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {r.system} | {r.same} | {r.ties} | {r.prefix:.1f} | {r.kl:.5f} |" for r in rows]
    return "\n".join(lines)


def measure(model_dir: str, dtype: str, questions: int, tokens: int) -> list[Drift]:
    """pdserve's drift and transformers', each against its own float32 answers."""
    loaded = load_model(model_dir, dtype="float32", device="cpu")
    tokenizer, end = loaded.tokenizer, set(loaded.config.eos_token_ids)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    prompts = prompts[:questions]
    rows, floats, others = [], [], []
    for system, answer in (("pdserve", pdserve_answers), ("transformers", transformers_answers)):
        print(f"dtype_quality: {system}, float32 and {dtype}", file=sys.stderr)
        floats.append(answer(model_dir, "float32", prompts, tokens, end))
        others.append(answer(model_dir, dtype, prompts, tokens, end))
        rows.append(drift(system, floats[-1], others[-1]))
    parity = drift("", floats[0], floats[1]).same
    print(f"dtype_quality: the two float32 answers equal on {parity} of {len(prompts)}")
    return [
        dataclasses.replace(row, ties=ties(loaded.model, prompts, reference, answers))
        for row, reference, answers in zip(rows, floats, others, strict=True)
    ]


def ties(model: CausalLM, prompts: list[list[int]], reference: Answers, other: Answers) -> int:
    """Questions whose answers part at a position where the float32 model's two best logits
    are within TIE (`model`: float32)."""
    n = 0
    for ids, a, b in zip(prompts, reference.tokens, other.tokens, strict=True):
        k = _common_prefix(a, b)
        if a == b or k == len(a):  # the same, or float32's ended first: no tie to find
            continue
        best = _last_logits(model, ids + a[:k]).topk(2).values
        n += float(best[0] - best[1]) < TIE
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    rows = measure(str(resolve(args.model)), args.dtype, args.questions, args.tokens)
    text = table(rows, args.dtype, min(args.questions, len(QUESTIONS)), args.tokens)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
