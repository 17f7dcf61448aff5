"""DeepSeek-VL on a DeepSeek-V3 text decoder through the whole service, as a user sends it with
the `openai` client: a tiny random checkpoint made by transformers
(tests/support/tiny_deepseek_vl.py) served by an encode worker, a prefill worker and a decode
worker on a keyed Redis store, behind the router, in every dtype `--dtype auto` picks here.
The answers are transformers' in float32 (its processor's prompt and pixels, its greedy
tokens) and, in bfloat16, one process's engine's, token for token: encode -> store -> prefill
-> store -> decode changes nothing. A repeated image is never encoded again."""

from __future__ import annotations

import io

import openai
import pytest
import torch
import transformers
from PIL import Image

from services.engine.engine import Engine
from services.engine.images import PromptImage, image_spans
from services.engine.params import SamplingParams
from services.engine.request import EngineRequest
from services.launcher import RouterProcess, WorkerProcess
from services.model.loader import load_model
from services.settings import EngineConfig
from tests.decode.test_images_e2e import data_url, image_part, text_part
from tests.support.cluster import load
from tests.support.dtypes import COMPUTE_DTYPES
from tests.support.redis_servers import RedisServer
from tests.support.tiny_deepseek_vl import IMAGE, TOKENS_PER_IMAGE, save_tiny_deepseek_vl
from tests.support.tiny_vision import picture

ANSWER = 10
FIRST, SECOND = picture(11, (50, 70)), picture(12, (40, 30), "JPEG")
PARTS = [text_part("Compare "), image_part(data_url(FIRST)), text_part(" with "),
         image_part(data_url(SECOND, "jpeg")), text_part(" now")]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, embedded_dir):
    path = tmp_path_factory.mktemp("deepseek-vl-v3")
    return path, save_tiny_deepseek_vl(path, embedded_dir, "deepseek_v3")


@pytest.fixture(scope="module", params=COMPUTE_DTYPES)
def stack(request, checkpoint, tmp_path_factory):
    dtype, path = request.param, str(checkpoint[0])
    logs = tmp_path_factory.mktemp(f"deepseek-vl-{dtype}")
    store = RedisServer(logs / "redis").start()
    common = ("--num-blocks", "128")
    workers = [
        WorkerProcess("encode", path, store.url, logs, dtype=dtype),
        WorkerProcess("prefill", path, store.url, logs, *common, dtype=dtype),
        WorkerProcess("decode", path, store.url, logs, *common, dtype=dtype),
    ]
    router = None
    try:
        for w in workers:
            w.launch()
        for w in workers:
            w.wait_ready()
        encode, prefill, decode = workers
        router = RouterProcess(
            logs, [prefill.address], [decode.address], f"--encode={encode.address}", model=path
        ).start()
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
        yield dtype, client, encode, prefill
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()
        store.stop()


def processed(checkpoint) -> tuple[list[int], torch.Tensor]:
    """transformers' processor on the conversation: its prompt ids and pixels."""
    processor = transformers.AutoProcessor.from_pretrained(str(checkpoint[0]))
    content = [{"type": "image"} if p["type"] == "image_url" else p for p in PARTS]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    images = [Image.open(io.BytesIO(f)) for f in (FIRST, SECOND)]
    out = processor(text=text, images=images, return_tensors="pt")
    return out["input_ids"][0].tolist(), out["pixel_values"]


def expected(checkpoint, dtype: str) -> list[int]:
    """float32: transformers' greedy tokens; bfloat16: one process's engine's (its logits
    follow transformers' bfloat16 ones: tests/services/model/test_deepseek_vl.py)."""
    ids, pixels = processed(checkpoint)
    if dtype == "float32":
        t = torch.tensor([ids])
        with torch.no_grad():
            out = checkpoint[1].generate(
                t, pixel_values=pixels, attention_mask=torch.ones_like(t),
                max_new_tokens=ANSWER, do_sample=False, pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
        return out[0, len(ids) :].tolist()
    loaded = load_model(str(checkpoint[0]), dtype=dtype, device="cpu")
    assert loaded.encoder is not None
    digests = [loaded.encoder.digest(f) for f in (FIRST, SECOND)]
    spans = image_spans(ids, IMAGE, TOKENS_PER_IMAGE, digests)
    images = tuple(PromptImage(s, loaded.encoder.encode(f))
                   for s, f in zip(spans, (FIRST, SECOND), strict=True))  # fmt: skip
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=64))
    params = SamplingParams(max_tokens=ANSWER, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest("x", ids, params, images=images))
    seq = engine.requests["x"].seqs[0]
    while engine.has_unfinished:
        engine.step()
    return list(seq.output_ids)


def test_answers_through_encode_prefill_store_decode(stack, checkpoint):
    """The prompt the router makes is the processor's; the answer is the reference's, streamed
    or not; each image was encoded once, by the encoder, and read from the store."""
    dtype, client, encode, prefill = stack
    want = expected(checkpoint, dtype)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": PARTS}]
    ask = dict(model=model, messages=messages, max_tokens=ANSWER, temperature=0,
               extra_body={"ignore_eos": True})  # fmt: skip
    reply = client.chat.completions.create(**ask)
    assert reply.usage.prompt_tokens == len(processed(checkpoint)[0])
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint[0]))
    assert reply.choices[0].message.content == tokenizer.decode(want)
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in client.chat.completions.create(**ask, stream=True)
                       if c.choices)  # fmt: skip
    assert streamed == tokenizer.decode(want)
    assert reply.usage.completion_tokens == ANSWER
    assert load(encode).images_encoded == 2
    assert load(prefill).images_encoded == 0 and load(prefill).images_from_store >= 2
