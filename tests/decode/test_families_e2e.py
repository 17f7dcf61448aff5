"""Checkpoints made by transformers, served by `pdserve up --no-colocated` over Redis: router ->
prefill worker -> blocks in the store -> decode worker. Answers equal transformers' token for
token, cold and with the prompt's blocks found in the store, for DeepSeek-V3 (latent attention,
MoE layers), DeepSeek-V3.2 (its lightning indexer's keys a cache group of their own, carried in
every block beside the latents), DeepSeek-V4 (issue 32: windows, CSA and HCA entries,
hyper-connections, hash and top-k experts; a token's cache state in its rows, the window part
released as it goes), gpt-oss (sliding and full layers, sinks) and Gemma 3 (local and global
layers). The store holds blocks of each family's layout: DeepSeek-V3's latent (576 elements a
token for its real shape, here the tiny model's 40), V3.2's latent and indexer key, V4's rows,
per-head K and V for the others."""

from __future__ import annotations

import httpx
import openai
import pytest
import redis
import torch

from kvstore.block_hash import block_hashes
from kvstore.codec import FORMAT, MAC_BYTES, BlockCodec, StorageDtype
from kvstore.keys import store_key
from services.launcher import free_port
from services.model import kv_cache
from services.model.loading import sources
from services.model.loading.hf_config import read_config
from services.tokenizer.tokenizer import Tokenizer
from tests.support.tiny_models import VOCAB, save_tiny
from tests.support.up import Up

NAME = "tiny-model"


@pytest.fixture(
    scope="module", params=["deepseek_v3", "deepseek_v32", "deepseek_v4", "gpt_oss", "gemma3"]
)
def checkpoint(request, tmp_path_factory, embedded_dir):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, save_tiny(request.param, path, embedded_dir)


@pytest.fixture(scope="module")
def served(checkpoint, redis_server):
    _, path, _ = checkpoint
    metrics = free_port()
    out = Up("--port", str(free_port()), "--model", str(path), "--served-model-name", NAME,
             "--kv-store", redis_server.url, "--no-colocated", "--dtype", "float32",
             "--num-blocks", "256", "--metrics-port", str(metrics))  # fmt: skip
    try:  # the prefill worker's side door on `metrics`, the decode worker's on the next port
        yield openai.OpenAI(base_url=out.ready(), api_key="none", max_retries=0), metrics
    finally:
        out.stop()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(100, VOCAB - 100, (n,), generator=g).tolist() for n in (40, 70, 9)]


def test_answers_equal_transformers_cold_and_from_the_store(checkpoint, served, redis_server):
    name, path, reference = checkpoint
    client, _ = served
    tokenizer = Tokenizer.from_dir(path)
    config = read_config(path)
    layout = kv_cache.layout(sources.fingerprint(path), "float32", 16, config)
    store = redis.Redis.from_url(redis_server.url)
    for prompt in prompts():
        with torch.inference_mode():
            expected = reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        text = tokenizer.decode(expected)
        for _ in ("cold", "warm"):
            r = client.completions.create(
                model=NAME,
                prompt=prompt,
                max_tokens=24,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert r.choices[0].text == text
            assert r.usage is not None and r.usage.completion_tokens == 24
        # the decode worker wrote back every full block of prompt and answer, whole (V4: with
        # its window part); the last token was never computed
        computed = block_hashes([*prompt, *expected[:-1]], 16, layout.namespace())
        assert all(store.exists(store_key(layout.namespace(), h)) for h in computed)

    # the store holds blocks of this model's layout
    codec = BlockCodec(layout, StorageDtype.FLOAT32)
    keys = [k for k in store.scan_iter(f"*{layout.namespace()}*")]
    assert keys, "no block of this model in the store"
    value = store.get(keys[0])
    assert value is not None and len(value) in (codec.value_bytes, codec.value_bytes + MAC_BYTES)
    _, _, _, _, layers, _, _, heads, k_dim, v_dim, *_ = FORMAT.unpack_from(value, 0)
    assert (layers, heads, k_dim, v_dim) == (config.cache_layers, *config.cache_shape)
    if name == "deepseek_v3":  # one "head" of latent + rotary key, no V
        assert (layers, heads, k_dim, v_dim) == (3, 1, 40, 0)
        assert codec.value_bytes - FORMAT.size == 3 * 16 * 40 * 4  # layers x tokens x latent
    if name == "deepseek_v32":  # the latent and rotary key, then the indexer's key
        assert (layers, heads, k_dim, v_dim) == (3, 1, 40 + 16, 0)


def test_each_worker_counts_the_tokens_routed_to_each_expert(checkpoint, served):
    """Every token a worker computes goes to top_k = 2 experts in each MoE layer (DeepSeek-V3:
    1 and 2): the layers' counts sum alike, and /metrics says what /experts says."""
    if checkpoint[0] != "deepseek_v3":
        pytest.skip("the V3 checkpoint's MoE layers are counted here")
    client, metrics = served
    client.completions.create(model=NAME, prompt=prompts()[0], max_tokens=4, temperature=0)
    for port in (metrics, metrics + 1):
        experts = httpx.get(f"http://127.0.0.1:{port}/experts").json()
        layers = experts["layers"]
        assert set(layers) == {"1", "2"} and all(len(c) == 8 for c in layers.values())
        assert sum(layers["1"]) == sum(layers["2"]) > 0 and sum(layers["1"]) % 2 == 0
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        for layer, counts in layers.items():
            for expert, count in enumerate(counts):
                line = (
                    f'pdserve_moe_expert_tokens_total{{expert="{expert}",layer="{layer}",'
                    f'role="{experts["role"]}"}} {float(count)}'
                )
                assert line in text
