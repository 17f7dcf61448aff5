"""Structured output's cost: the grammar engines on the embedded tokenizer, then 32 sequences
with a JSON schema against the same load unconstrained, in the engine and (--serving) through
`pdserve up` with 32 concurrent streams of the official client.

    python -m bench.structured [--sequences 32] [--tokens 128] [--serving]

Grammar engines: llguidance (what pdserve runs) and, where it is installed, xgrammar (vLLM's
default): the tokenizer's conversion, a schema's grammar (llguidance builds it lazily, xgrammar
compiles it), and one mask: at batch 1 (median over a valid answer's tokens) and for 32 rows.
The load: the schema asks for a 100-string array, so no answer completes before `--tokens`
and both runs generate the same number of tokens. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import llguidance
import torch

from bench.serving import MODEL_ID
from router.completions.structured import compile_grammar
from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.model.loader import LoadedModel, load_model
from services.tokenizer.tokenizer import Tokenizer

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested + enum": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "bb", "ccc"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["tags", "address"],
    },
    "$defs / $ref": {
        "$defs": {
            "p": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"corners": {"type": "array", "items": {"$ref": "#/$defs/p"}, "minItems": 3}},
        "required": ["corners"],
    },
}
EXAMPLES = {
    "flat": {"name": "Ada Lovelace", "age": 36},
    "nested + enum": {"tags": ["a", "ccc"], "address": {"city": "London", "zip": "12345"}},
    "$defs / $ref": {"corners": [{"x": 1, "y": 2}, {"x": 3, "y": 4}, {"x": 5, "y": 6}]},
}
LONG = {
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 100, "items": {"type": "string"}}},
    "required": ["items"],
    "additionalProperties": False,
}
# the same with bounded strings: llguidance's lexer then tracks every length (docs/benchmarks.md)
BOUNDED = {**LONG, "properties": {"items": {"type": "array", "minItems": 100,
           "items": {"type": "string", "minLength": 8, "maxLength": 24}}}}  # fmt: skip


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def timed(fn: Callable[[], object]) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def llguidance_row(tok: Tokenizer, vocab: int, eos: list[int], name: str) -> list[str]:
    begin = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=eos)
    setup = time.perf_counter() - begin
    schema = json.dumps(SCHEMAS[name])
    begin = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    llguidance.LLMatcher(lltok, grammar)
    build = time.perf_counter() - begin
    ids = tok.encode(json.dumps(EXAMPLES[name]), add_special_tokens=False)
    one, many = [], []
    words = (vocab + 31) // 32
    bits = torch.zeros(32, words, dtype=torch.int32)
    executor = llguidance.LLExecutor()
    single = llguidance.LLMatcher(lltok, grammar)
    batch = [llguidance.LLMatcher(lltok, grammar) for _ in range(32)]
    pairs = [(m, i) for i, m in enumerate(batch)]
    ptr = bits.data_ptr()
    for t in ids:
        one.append(timed(lambda: single.unsafe_compute_mask_ptr(ptr, words * 4)))
        many.append(timed(lambda: executor.unsafe_compute_mask_ptr(pairs, ptr, words * 4, 32)))
        single.consume_token(t)
        for m in batch:
            m.consume_token(t)
    return ["llguidance", name, ms(setup), ms(build), f"{statistics.median(one) * 1e6:.0f}",
            ms(statistics.median(many))]  # fmt: skip


def xgrammar_row(tok: Tokenizer, vocab: int, name: str) -> list[str] | None:
    try:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=tok.eos_token)
    begin = time.perf_counter()
    compiler = xgrammar.GrammarCompiler(
        xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    )
    setup = time.perf_counter() - begin
    begin = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMAS[name]))
    build = time.perf_counter() - begin
    ids = tok.encode(json.dumps(EXAMPLES[name]), add_special_tokens=False)
    bits = xgrammar.allocate_token_bitmask(32, vocab)
    single = xgrammar.GrammarMatcher(compiled)
    batch = [xgrammar.GrammarMatcher(compiled) for _ in range(32)]
    one, many = [], []
    for t in ids:
        one.append(timed(lambda: single.fill_next_token_bitmask(bits, 0)))
        many.append(
            timed(lambda: [m.fill_next_token_bitmask(bits, i) for i, m in enumerate(batch)])
        )
        single.accept_token(t)
        for m in batch:
            m.accept_token(t)
    return ["xgrammar", name, ms(setup), ms(build), f"{statistics.median(one) * 1e6:.0f}",
            ms(statistics.median(many))]  # fmt: skip


def engines_table(loaded: LoadedModel) -> str:
    tok, mc = loaded.tokenizer, loaded.model.config
    eos = list(mc.eos_token_ids)
    rows = []
    for name in SCHEMAS:
        rows.append(llguidance_row(tok, mc.vocab_size, eos, name))
        x = xgrammar_row(tok, mc.vocab_size, name)
        rows += [x] if x else []
    head = ["engine", "schema", "tokenizer ms", "grammar ms", "mask b=1 us", "mask 32 rows ms"]
    return markdown(head, rows)


def prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    asks = [f"List {100 + k} things one finds in a kitchen, as JSON." for k in range(n)]
    return [tok.encode_chat([{"role": "user", "content": a}]) for a in asks]


def engine_table(loaded: LoadedModel, sequences: int, tokens: int) -> str:
    ids = prompts(loaded.tokenizer, sequences)
    rows, speeds = [], {}
    loads: list[tuple[str, dict[str, Any]]] = [("unconstrained", {"ignore_eos": True})]
    for label, schema in (("JSON schema", LONG), ("JSON schema, strings 8-24", BOUNDED)):
        grammar, error = compile_grammar("json", json.dumps(schema))
        assert not error, error
        loads.append((label, {"grammar": grammar}))
    for label, extra in loads:
        engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=64 * sequences))
        _ = engine.grammars.lltokenizer  # converted before the clock starts (once per worker)
        params = SamplingParams(max_tokens=tokens, temperature=0.8, seed=1, **extra)
        begin = time.perf_counter()
        out = engine.generate(ids, params)
        wall = time.perf_counter() - begin
        made = sum(len(c.token_ids) for o in out for c in o.choices)
        speeds[label] = made / wall
        t, m = engine.times, engine.grammars.times
        mask = m.seconds / m.steps if m.steps else 0.0
        step = (t.schedule + t.forward + t.sample) / t.steps
        rows.append([label, str(made), f"{made / wall:.1f}", ms(step), ms(mask),
                     f"{mask / step:.1%}" if m.steps else "-",
                     f"{speeds[label] / speeds['unconstrained']:.2f}x"])  # fmt: skip
    head = ["load", "tokens", "tok/s", "step ms", "mask ms / step", "mask share", "vs free"]
    return markdown(head, rows)


async def stream_all(base: str, sequences: int, tokens: int, constrained: bool) -> int:
    import openai

    client = openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0)
    schema = {"type": "json_schema", "json_schema": {"name": "list", "schema": LONG}}
    extra = {"response_format": schema} if constrained else {"extra_body": {"ignore_eos": True}}

    async def one(k: int) -> int:
        stream = await client.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": f"List {100 + k} things."}],
            max_tokens=tokens,
            temperature=0.8,
            seed=k,
            stream=True,
            stream_options={"include_usage": True},
            **extra,
        )
        used = 0
        async for chunk in stream:
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
        return used

    return sum(await asyncio.gather(*(one(k) for k in range(sequences))))


def serving_table(sequences: int, tokens: int) -> str:
    from bench.serving import wait_ready
    from services.launcher import PDSERVE, free_port

    port = free_port()
    up = subprocess.Popen(
        [PDSERVE, "up", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}", up, 600)
        base = f"http://127.0.0.1:{port}/v1"
        asyncio.run(stream_all(base, 4, 8, True))  # warm: the workers convert the tokenizer
        rows, speeds = [], {}
        for label, constrained in (("unconstrained", False), ("JSON schema", True)):
            begin = time.perf_counter()
            made = asyncio.run(stream_all(base, sequences, tokens, constrained))
            speeds[label] = made / (time.perf_counter() - begin)
            rows.append([label, str(made), f"{speeds[label]:.1f}"])
        rows[0].append("1.00x")
        rows[1].append(f"{speeds['JSON schema'] / speeds['unconstrained']:.2f}x")
        return markdown(["load (pdserve up, streams)", "tokens", "tok/s", "vs free"], rows)
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)


def markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--serving", action="store_true", help="also through `pdserve up`")
    args = parser.parse_args(argv)
    loaded = load_model("embedded", dtype=args.dtype)
    print(engines_table(loaded), end="\n\n")
    print(engine_table(loaded, args.sequences, args.tokens), end="\n\n")
    if args.serving:
        print(serving_table(args.sequences, args.tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
