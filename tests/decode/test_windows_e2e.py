"""The window-and-sink families, each a checkpoint made by transformers, served by `pdserve up
--no-colocated` over Redis: router -> prefill worker -> blocks in the store -> decode worker.
Their answers equal transformers' token for token, cold and with the prompt's blocks found in
the store: DeepSeek-V4 (issue 32: windows, CSA and HCA entries, hyper-connections, hash and
top-k experts; a token's whole cache state in its row), gpt-oss (sliding and full layers,
sinks) and Gemma 3 (local and global layers). The store's blocks have the family's layout."""

from __future__ import annotations

import openai
import pytest
import redis
import torch

from kvstore.codec import FORMAT, MAC_BYTES, BlockCodec, StorageDtype
from services.launcher import free_port
from services.model import kv_cache, sources
from services.model.hf_config import read_config
from services.tokenizer.tokenizer import Tokenizer
from tests.support.tiny_models import VOCAB, save_tiny
from tests.support.up import Up

NAME = "tiny-window"


@pytest.fixture(scope="module", params=["deepseek_v4", "gpt_oss", "gemma3"])
def checkpoint(request, tmp_path_factory, embedded_dir):
    path = tmp_path_factory.mktemp(request.param)
    return path, save_tiny(request.param, path, embedded_dir)


@pytest.fixture(scope="module")
def served(checkpoint, redis_server):
    path, _ = checkpoint
    out = Up("--port", str(free_port()), "--model", str(path), "--served-model-name", NAME,
             "--kv-store", redis_server.url, "--no-colocated", "--dtype", "float32",
             "--num-blocks", "256", "--metrics-port", str(free_port()))  # fmt: skip
    try:
        yield openai.OpenAI(base_url=out.ready(), api_key="none", max_retries=0)
    finally:
        out.stop()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(12)
    return [torch.randint(100, VOCAB - 100, (n,), generator=g).tolist() for n in (70, 95, 9)]


def test_answers_equal_transformers_cold_and_from_the_store(checkpoint, served, redis_server):
    path, reference = checkpoint
    tokenizer = Tokenizer.from_dir(path)
    for prompt in prompts():
        with torch.inference_mode():
            expected = reference.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0,
            )[0, len(prompt) :].tolist()  # fmt: skip
        for _ in ("cold", "warm"):
            r = served.completions.create(
                model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert r.choices[0].text == tokenizer.decode(expected)
    config = read_config(path)
    layout = kv_cache.layout(sources.fingerprint(path), "float32", 16, config)
    codec = BlockCodec(layout, StorageDtype.FLOAT32)
    client = redis.Redis.from_url(redis_server.url)
    keys = list(client.scan_iter(f"*{layout.namespace()}*"))
    assert keys, "no block of this model in the store"
    value = client.get(keys[0])
    assert value is not None and len(value) in (codec.value_bytes, codec.value_bytes + MAC_BYTES)
    _, _, _, _, layers, _, _, heads, k_dim, v_dim, *_ = FORMAT.unpack_from(value, 0)
    assert (layers, heads, k_dim, v_dim) == (config.cache_layers, *config.cache_shape)
