"""What approximate KV reuse saves of the time to first token (issue 55, item 4), through real
stacks (`pdserve up`) and the openai client, colocated and through the store.

    python -m bench.kv_reuse_ttft [--docs 2,4,8] [--prompts 3] [--ratios 0,0.05,0.15,0.3]
                                  [--topologies colocated,...] [--quality Q.json ...]
                                  [--plot F.png] [--json F] [--rows F]

Per stack (colocated: one worker computing prompts and decoding; through the store: a prefill
worker, a local store, a decode worker; chunks from the store: the same, the documents read
by another stack before it, so that every chunk is read from the store) and per ratio
(`--kv-reuse-ratio`, a stack each): a pool of documents of ~500 tokens
(bench/kv_reuse_quality.py's) is read once, each after a system prompt of its own; then for
each document count, `prompts` chats of a new system prompt, that many documents in a
shuffled order (a message each) and a question, asked exactly (`kv_reuse: exact`: every
token computed, no prefix cached) and approximately (the documents placed), each with a
system prompt no other request has. TTFT is the first content chunk of a streamed answer.
With `--quality` (kv_reuse_quality.py's JSON for the same document counts) it plots quality
(KL against full recomputation) against TTFT.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

from bench.images import machine
from bench.kv_reuse_quality import Doc, make_doc
from services.launcher import free_port
from tests.support.up import Up

DISAGGREGATED = ("--no-colocated", "--num-prefill", "1", "--num-decode", "1")
TOPOLOGIES = {
    "colocated": ("--colocated",),
    "through the store": DISAGGREGATED,
    # the documents read by one stack, the prompts asked of a fresh one on the same store:
    # every chunk placed was read from the store (services/worker/chunk_link.py)
    "chunks from the store": DISAGGREGATED,
}
RESTARTED = {"chunks from the store"}


def ask(client: openai.OpenAI, model: str, messages: list[Any], kv_reuse: str) -> tuple[float, int]:
    """TTFT in ms, the answer streamed (4 tokens), and the prompt tokens placed (usage)."""
    start = time.perf_counter()
    stream: Any = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"kv_reuse": kv_reuse, "ignore_eos": True},
    )  # fmt: skip
    first, placed = None, 0
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content is not None:
            first = time.perf_counter()
        if chunk.usage is not None:
            placed = (chunk.usage.prompt_tokens_details.model_dump()).get("approximate_tokens", 0)
    assert first is not None
    return 1000 * (first - start), placed


def chat(system: str, docs: list[Doc], question: str) -> list[dict]:
    return [{"role": "system", "content": system},
            *({"role": "user", "content": d.text} for d in docs),
            {"role": "user", "content": question}]  # fmt: skip


def measure(
    base_url: str, counts: list[int], prompts: int, words: int, sight: bool = True
) -> dict[str, Any]:
    """Median TTFTs per document count (`sight`: the pool read first, here; else `prompts`
    is 0 for a stack that only reads it)."""
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    rng = random.Random(55)
    pool = [make_doc(rng, words, i) for i in range(max(counts))]
    ask(client, model, [{"role": "user", "content": "warm up"}], "exact")
    for i, d in enumerate(pool if sight else ()):  # each document's first sighting
        ask(client, model, chat(f"Archive {i}: summarise.", [d], "Summarise."), "approximate")
    out: dict[str, Any] = {}
    if prompts == 0:
        return out
    for n in counts:
        times: dict[str, list[float]] = {"exact": [], "approximate": []}
        placed = []
        for k in range(prompts):
            docs = rng.sample(pool, n)
            asked = rng.choice(docs)
            for mode in times:
                system = f"Session {n}-{k} ({mode}): answer from the documents."
                ms, tokens = ask(client, model, chat(system, docs, asked.question), mode)
                times[mode].append(ms)
                placed += [tokens] if mode == "approximate" else []
        out[str(n)] = {m: statistics.median(t) for m, t in times.items()}
        out[str(n)]["placed"] = statistics.median(placed)
    return out


def stack(topology: str, ratio: float, counts: list[int], prompts: int, words: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-kv-reuse-"))
    args = ("--kv-store", f"local://{work}/kv", "--kv-reuse-ratio", str(ratio),
            *TOPOLOGIES[topology])  # fmt: skip
    restarted = topology in RESTARTED
    if restarted:  # a stack that reads the documents, and is gone
        up = Up("--port", str(free_port()), *args)
        try:
            measure(up.ready(), counts, 0, words)
        finally:
            up.stop()
    up = Up("--port", str(free_port()), *args)
    try:
        return measure(up.ready(), counts, prompts, words, sight=not restarted)
    finally:
        up.stop()


def plot(rows: list[dict], quality: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in sorted({r["docs"] for r in rows}):
        if str(n) not in quality:
            continue
        for topology, marker in zip(TOPOLOGIES, "os^", strict=True):
            points = [r for r in rows if r["docs"] == n and r["topology"] == topology]
            xs = [r["approximate_ms"] for r in points]
            ys = [quality[str(n)]["ratios"][str(r["ratio"])]["kl"] for r in points]
            ax.plot(xs, ys, marker=marker, label=f"{n} documents, {topology}")
            for r, x, y in zip(points, xs, ys, strict=True) if marker == "o" else ():
                ax.annotate(f"{r['ratio']:.0%}", (x, y), textcoords="offset points", xytext=(4, 4))
            exact = statistics.median(r["exact_ms"] for r in points)
            ax.axvline(exact, linestyle=":", color=ax.lines[-1].get_color())
    ax.set_xlabel("TTFT, ms (dotted: exact, every token computed)")
    ax.set_ylabel("mean KL to full recomputation (16 positions)")
    ax.set_title("Approximate KV reuse: quality against time to first token")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", default="2,4,8")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--ratios", default="0,0.05,0.15,0.3")
    p.add_argument("--topologies", default=",".join(TOPOLOGIES))
    p.add_argument("--words", type=int, default=330, help="words a document (~500 tokens)")
    p.add_argument("--quality", type=Path, nargs="*", default=[])
    p.add_argument("--plot", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--rows", type=Path, help="plot the rows of an earlier run's --json instead")
    a = p.parse_args()
    counts = [int(x) for x in a.docs.split(",")]
    rows = json.loads(a.rows.read_text())["rows"] if a.rows else []
    for topology in a.topologies.split(",") if not a.rows else ():
        for ratio in (float(x) for x in a.ratios.split(",")):
            start = time.perf_counter()
            result = stack(topology, ratio, counts, a.prompts, a.words)
            for n, t in result.items():
                rows.append({"topology": topology, "ratio": ratio, "docs": int(n),
                             "exact_ms": t["exact"], "approximate_ms": t["approximate"],
                             "placed_tokens": t["placed"]})  # fmt: skip
                print(f"{topology:18} ratio {ratio:4.0%} {n} docs: exact {t['exact']:7.0f} ms, "
                      f"approximate {t['approximate']:7.0f} ms "
                      f"({t['approximate'] / t['exact']:.2f}x, {t['placed']:.0f} tokens "
                      "placed)", flush=True)  # fmt: skip
            print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    out = {"machine": machine(), "rows": rows}
    if a.json and not a.rows:
        a.json.write_text(json.dumps(out, indent=1))
    if a.plot and a.quality:
        quality: dict[str, Any] = {}
        for f in a.quality:  # kv_reuse_quality.py's results, a list
            quality |= {str(r["docs"]): r for r in json.loads(f.read_text())}
        plot(rows, quality, a.plot)


if __name__ == "__main__":
    main()
