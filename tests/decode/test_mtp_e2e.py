"""`pdserve up --speculative mtp --no-colocated` over a DeepSeek-V3 and a V4 checkpoint with
an MTP layer (made here; the layer repeats the target's, so it drafts well): through the router and
the official client, greedy and seeded answers equal the engine's without speculation, the
decode worker drafting without the prompt's hidden states (the prefill worker computed them);
its counters say what it proposed and kept. A checkpoint without an MTP layer is refused
before anything loads."""

from __future__ import annotations

import re
import subprocess

import httpx
import openai
import pytest
import torch

from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams
from services.launcher import PDSERVE, free_port
from services.model.loader import load_model
from tests.support.tiny_models import save_tiny_mtp, save_tiny_v4_mtp
from tests.support.up import Up

NAME = "tiny-mtp"


@pytest.mark.parametrize("save", [save_tiny_mtp, save_tiny_v4_mtp], ids=["v3", "v4"])
def test_mtp_drafts_through_the_whole_path(tmp_path, embedded_dir, save):
    path = tmp_path / "mtp"
    save(path, embedded_dir, copy=True)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (40, 12, 25)]
    params = [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True),
    ]
    loaded = load_model(str(path), dtype="float32", device="cpu")
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=128))
    expected = [[o.choices[0].token_ids for o in engine.generate(prompts, p)] for p in params]
    metrics = free_port()
    out = Up("--port", str(free_port()), "--model", str(path), "--served-model-name", NAME,
             "--kv-store", f"local://{tmp_path}/kv", "--num-blocks", "128", "--no-colocated",
             "--dtype", "float32", "--speculative", "mtp",
             "--metrics-port", str(metrics))  # fmt: skip
    try:
        client = openai.OpenAI(base_url=out.ready(), api_key="none", max_retries=0)
        for p, want in zip(params, expected, strict=True):
            got = []
            for prompt in prompts:
                reply = client.completions.create(
                    model=NAME,
                    prompt=prompt,
                    max_tokens=20,
                    temperature=p.temperature,
                    seed=p.seed,
                    logprobs=0,
                    extra_body={"ignore_eos": True},
                )
                got.append(reply.choices[0].logprobs.tokens)
            assert got == [[loaded.tokenizer.decode([t]) for t in w] for w in want]
        scraped = httpx.get(f"http://127.0.0.1:{metrics + 1}/metrics").text  # decode worker
    finally:
        out.stop()
    pattern = r'^(pdserve_spec_\w+)_total\{role="decode"\} (\S+)$'
    counts = {name: float(value) for name, value in re.findall(pattern, scraped, re.M)}
    print(counts)
    assert counts["pdserve_spec_proposed_tokens"] > 20
    assert counts["pdserve_spec_accepted_tokens"] >= 0.6 * counts["pdserve_spec_proposed_tokens"]


@pytest.mark.parametrize(
    ("family", "why"),
    [
        ("qwen3_moe", "needs a DeepSeek-V3 or V4 checkpoint"),
        ("deepseek_v4", r"no MTP layer: mtp\.0\.e_proj\.weight is missing"),  # declared, not stored
    ],
)
def test_mtp_without_an_mtp_layer_is_refused_before_the_model_loads(tiny_dir, family, why):
    result = subprocess.run(
        [
            PDSERVE,
            "decode",
            "--model",
            str(tiny_dir(family)),
            "--speculative",
            "mtp",
            "--kv-store",
            "memory://",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "has no MTP layer (num_nextn_predict_layers)" in result.stderr
    assert re.search(why, result.stderr), result.stderr
