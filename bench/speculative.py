"""Speculative decoding's gain: one stream on input-grounded prompts (repeat, edit or
summarise a given text or code: outputs copy from the prompt), one stream on open questions
(short stories: little to copy) and one on random-token prompts, and 32 concurrent grounded
streams; each without speculation and with the n-gram and suffix proposers, in one run, in
the engine and (--serving) through `pdserve up`.

    python -m bench.speculative [--tokens 128] [--prompts 12] [--concurrent 32] [--serving]
                                [--plot FILE]
    python -m bench.speculative --sweep 1,2,4,8,16   (where speculation stops paying)

Greedy decoding, so every configuration generates the same tokens (the engine's guarantee,
checked here too) and tok/s compare like for like. Prints Markdown tables: tokens/s, the ratio
to no speculation, and the acceptance figures (tokens proposed, accepted, accepted per
verification, tokens per engine step).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.model.families.llama.model import DecoderModel
from services.model.loader import LoadedModel, load_model
from services.model.loading import hf_config, hf_dir
from services.settings import SpeculativeConfig

TEXTS = [
    '''def parse_config(path):
    """Read a key = value file into a dict, skipping comments and blank lines."""
    settings = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings''',
    """The meeting is moved to Thursday at 3 pm in room 204. Please bring the quarterly report,
the budget spreadsheet and your notes from the customer interviews. Maria will present the
results of the survey, and Tom will give an update on the hiring plan for the next quarter.""",
    """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1] if self.items else None""",
    """Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide
to make glucose and oxygen. It takes place in the chloroplasts, which contain the green
pigment chlorophyll. The oxygen is released into the air, and the glucose is used by the plant
for energy and growth.""",
    """SELECT customers.name, orders.total, orders.created_at
FROM customers
JOIN orders ON orders.customer_id = customers.id
WHERE orders.total > 100 AND orders.created_at >= '2024-01-01'
ORDER BY orders.total DESC
LIMIT 20;""",
    """<ul>
  <li><a href="/home">Home</a></li>
  <li><a href="/about">About us</a></li>
  <li><a href="/products">Products</a></li>
  <li><a href="/contact">Contact</a></li>
</ul>""",
]
ASKS = [
    "Repeat the following text exactly, without any change:\n\n{}",
    "Fix any typos in this and return the whole text:\n\n{}",
    "Rewrite the following with the same content, keeping every line:\n\n{}",
    "Summarise the following, quoting its key lines:\n\n{}",
]
# open questions: little in the prompt to copy (where speculation cannot help much)
TOPICS = ["a dragon", "the ocean", "a robot learning to paint", "winter in a small town",
          "a lost key", "the first day of school", "a chess match", "a storm at sea",
          "an old lighthouse", "a market in Marrakesh", "a time traveller", "a garden"]  # fmt: skip
CONFIGS: list[tuple[str, SpeculativeConfig]] = [
    ("off", SpeculativeConfig()),
    ("ngram", SpeculativeConfig("ngram")),
    ("suffix", SpeculativeConfig("suffix")),
]


def grounded(loaded: LoadedModel, count: int) -> list[list[int]]:
    return [
        loaded.tokenizer.encode_chat(
            [{"role": "user", "content": ASKS[i % len(ASKS)].format(TEXTS[i % len(TEXTS)])}]
        )
        for i in range(count)
    ]


def open_questions(loaded: LoadedModel, count: int) -> list[list[int]]:
    return [
        loaded.tokenizer.encode_chat(
            [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}."}]
        )
        for i in range(count)
    ]


def random_prompts(count: int, length: int = 200) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, 49000, (length,), generator=g).tolist() for _ in range(count)]


@dataclass
class Run:
    tokens: int
    seconds: float
    steps: int
    proposed: int = 0
    accepted: int = 0
    verified: int = 0
    outputs: list[list[int]] | None = None

    @property
    def speed(self) -> float:
        return self.tokens / self.seconds


def layer_skip_draft(loaded: LoadedModel, layers: int) -> DecoderModel:
    """A draft made of the target's own first `layers` layers, its final norm and head (no
    other small model shares SmolLM2-135M's tokenizer here)."""
    config = hf_config.read_config(loaded.path)
    weights = hf_dir.read_weights(loaded.path, config)
    kept = {
        name: w
        for name, w in weights.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    }
    small = dataclasses.replace(config, num_layers=layers)
    return DecoderModel(small, kept, loaded.model.dtype, loaded.model.device)


def run(
    loaded: LoadedModel,
    spec: SpeculativeConfig,
    prompts: Sequence[list[int]],
    tokens: int,
    concurrent: bool,
    draft: DecoderModel | None = None,
) -> Run:
    engine = Engine(
        loaded.model, loaded.tokenizer, EngineConfig(num_blocks=2048, speculative=spec), draft
    )
    params = SamplingParams(max_tokens=tokens, temperature=0)
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # warm
    engine.times.steps = 0
    begin = time.perf_counter()
    if concurrent:
        outputs = engine.generate(prompts, params)
    else:
        outputs = [o for p in prompts for o in engine.generate([p], params)]
    seconds = time.perf_counter() - begin
    made = [o.choices[0].token_ids for o in outputs]
    stats = engine.speculator.stats if engine.speculator else None
    return Run(
        sum(len(m) for m in made),
        seconds,
        engine.times.steps,
        stats.proposed if stats else 0,
        stats.accepted if stats else 0,
        stats.steps if stats else 0,
        made,
    )


def row(workload: str, name: str, r: Run, base: Run) -> list[str]:
    per_verify = f"{r.accepted / r.verified:.2f}" if r.verified else "-"
    rate = f"{r.accepted / r.proposed:.0%}" if r.proposed else "-"
    return [workload, name, str(r.tokens), f"{r.speed:.1f}", f"{r.speed / base.speed:.2f}x",
            str(r.proposed), f"{r.accepted} ({rate})", per_verify,
            f"{r.tokens / r.steps:.2f}" if r.steps else "-"]  # fmt: skip


def engine_table(
    loaded: LoadedModel, count: int, tokens: int, concurrent: int = 32, draft_layers: int = 0
) -> tuple[str, dict[str, float]]:
    configs = list(CONFIGS)
    draft = layer_skip_draft(loaded, draft_layers) if draft_layers else None
    if draft is not None:
        configs.append((f"draft ({draft_layers} layers)", SpeculativeConfig("draft")))
    workloads = [
        ("grounded, 1 stream", grounded(loaded, count), False),
        ("open questions, 1 stream", open_questions(loaded, max(2, count // 2)), False),
        ("random tokens, 1 stream", random_prompts(max(2, count // 3)), False),
        (f"grounded, {concurrent} concurrent", grounded(loaded, concurrent), True),
    ]
    rows, ratios = [], {}
    for workload, prompts, concurrent in workloads:
        base = None
        for name, spec in configs:
            r = run(loaded, spec, prompts, tokens, concurrent, draft)
            base = base or r
            assert r.outputs == base.outputs, f"{name}: other tokens than without speculation"
            rows.append(row(workload, name, r, base))
            ratios[f"{workload} / {name}"] = r.speed / base.speed
    head = ["workload", "speculation", "tokens", "tok/s", "vs off", "proposed", "accepted",
            "accepted / verify", "tokens / step"]  # fmt: skip
    return markdown(head, rows), ratios


def sweep_table(loaded: LoadedModel, batches: list[int], tokens: int) -> str:
    """Speculation at every batch size (no batch gate): where it stops paying, which is what
    --speculative-max-batch should be."""
    rows = []
    for b in batches:
        prompts = grounded(loaded, b)
        off = run(loaded, SpeculativeConfig(), prompts, tokens, True)
        on = run(loaded, SpeculativeConfig("ngram", max_batch=1 << 20), prompts, tokens, True)
        assert on.outputs == off.outputs
        rows.append([str(b), f"{off.speed:.1f}", f"{on.speed:.1f}", f"{on.speed / off.speed:.2f}x",
                     f"{on.accepted / on.proposed:.0%}" if on.proposed else "-"])  # fmt: skip
    return markdown(["sequences", "off tok/s", "ngram tok/s", "ngram / off", "accepted"], rows)


async def one_stream(base: str, prompts: list[str], tokens: int) -> int:
    import openai

    from bench.serving import MODEL_ID

    client = openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0)
    made = 0
    for text in prompts:
        out = await client.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": text}],
            max_tokens=tokens,
            temperature=0,
        )
        assert out.usage is not None
        made += out.usage.completion_tokens
    return made


def serving_table(count: int, tokens: int) -> str:
    from bench.serving import wait_ready
    from services.launcher import PDSERVE, free_port

    texts = [ASKS[i % len(ASKS)].format(TEXTS[i % len(TEXTS)]) for i in range(count)]
    rows, base = [], 0.0
    for name, spec in CONFIGS:
        port = free_port()
        extra = ["--speculative", spec.method] if spec else []
        up = subprocess.Popen(
            [PDSERVE, "up", "--port", str(port), *extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_ready(f"http://127.0.0.1:{port}", up, 600)
            url = f"http://127.0.0.1:{port}/v1"
            asyncio.run(one_stream(url, texts[:1], 4))  # warm
            begin = time.perf_counter()
            made = asyncio.run(one_stream(url, texts, tokens))
            speed = made / (time.perf_counter() - begin)
            base = base or speed
            rows.append(["grounded, 1 stream", name, str(made), f"{speed:.1f}",
                         f"{speed / base:.2f}x"])  # fmt: skip
        finally:
            up.send_signal(signal.SIGINT)
            up.wait(60)
    return markdown(["workload (pdserve up)", "speculation", "tokens", "tok/s", "vs off"], rows)


def plot(ratios: dict[str, float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = list(ratios)
    ax.barh(names, [ratios[n] for n in names], color="tab:blue")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("tokens/s against no speculation")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=12, help="one-stream prompts")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--concurrent", type=int, default=32, help="streams of the batch load")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--serving", action="store_true", help="also through `pdserve up`")
    parser.add_argument("--plot", help="write the ratios as a PNG bar chart here")
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=0,
        help="also speculate with a draft made of the model's first N layers",
    )
    parser.add_argument(
        "--sweep",
        help="batch sizes to run with and without speculation, no batch gate (e.g. 1,2,4,8,16)",
    )
    args = parser.parse_args(argv)
    loaded = load_model("embedded", dtype=args.dtype)
    if args.sweep:
        batches = [int(b) for b in args.sweep.split(",")]
        print(f"engine, {loaded.model.dtype}\n\n{sweep_table(loaded, batches, args.tokens)}\n")
        return 0
    table, ratios = engine_table(
        loaded, args.prompts, args.tokens, args.concurrent, args.draft_layers
    )
    print(f"engine, {loaded.model.dtype}\n\n{table}\n")
    if args.plot:
        plot(ratios, args.plot)
    if args.serving:
        print(serving_table(args.prompts, args.tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
