"""Both vision families through the whole service in every dtype `--dtype auto` picks here, as
a user sends them with the `openai` client: tiny random checkpoints made by transformers
(DeepSeek-VL on a DeepSeek-V3 decoder, tests/support/tiny_deepseek_vl.py; Gemma 3,
tests/support/tiny_vision.py) served by an encode worker, a prefill worker and a decode worker
on a Redis store, behind the router. The answers are transformers' in float32 (its
processor's prompt and pixels, its greedy tokens) and, in bfloat16, one process's engine's,
token for token: encode -> store -> prefill -> store -> decode changes nothing. Each image is
encoded once, by one of two encoders; an encoder killed, its images go to the other. (Gemma 3
in float32, with the other faults: test_images_e2e.py.)"""

from __future__ import annotations

import io
import signal

import openai
import pytest
import torch
import transformers
from PIL import Image

from router.workers.encoding import pick
from services.engine.engine import Engine
from services.engine.images import PromptImage, image_spans
from services.engine.params import SamplingParams
from services.engine.request import EngineRequest
from services.launcher import RouterProcess, WorkerProcess
from services.model.loader import load_model
from services.settings import EngineConfig
from tests.decode.test_images_e2e import data_url, image_part, text_part
from tests.support import tiny_deepseek_vl, tiny_vision
from tests.support.cluster import load
from tests.support.dtypes import COMPUTE_DTYPES
from tests.support.redis_servers import RedisServer
from tests.support.tiny_vision import picture

ANSWER = 10
FIRST, SECOND = picture(11, (50, 70)), picture(12, (40, 30), "JPEG")
PARTS = [text_part("Compare "), image_part(data_url(FIRST)), text_part(" with "),
         image_part(data_url(SECOND, "jpeg")), text_part(" now")]  # fmt: skip


FAMILIES = {  # the family's saver, its image token, its tokens an image
    "deepseek_vl": (tiny_deepseek_vl.save_tiny_deepseek_vl, tiny_deepseek_vl.IMAGE, 16),
    "gemma3": (tiny_vision.save_tiny_gemma3_vision, tiny_vision.IMAGE, 16),
}
BF16 = [p for p in COMPUTE_DTYPES if p.id == "bfloat16"]
CASES = [
    pytest.param(("deepseek_vl", "float32"), id="deepseek_vl-float32"),
    *(pytest.param(("deepseek_vl", "bfloat16"), marks=p.marks, id="deepseek_vl-bfloat16")
      for p in BF16),
    *(pytest.param(("gemma3", "bfloat16"), marks=p.marks, id="gemma3-bfloat16") for p in BF16),
]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, embedded_dir):
    made: dict = {}

    def get(family: str):
        if family not in made:
            path = tmp_path_factory.mktemp(family)
            made[family] = path, FAMILIES[family][0](path, embedded_dir)
        return made[family]

    return get


@pytest.fixture(scope="module", params=CASES)
def stack(request, checkpoints, tmp_path_factory):
    family, dtype = request.param
    checkpoint = checkpoints(family)
    path = str(checkpoint[0])
    logs = tmp_path_factory.mktemp(f"{family}-{dtype}")
    store = RedisServer(logs / "redis").start()
    common = ("--num-blocks", "128")
    workers = [
        WorkerProcess("encode", path, store.url, logs, dtype=dtype),
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
        *encoders, prefill, decode = workers
        router = RouterProcess(
            logs, [prefill.address], [decode.address],
            f"--encode={','.join(e.address for e in encoders)}", model=path,
        ).start()  # fmt: skip
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
        yield family, dtype, checkpoint, client, encoders, prefill
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()
        store.stop()


def processed(
    checkpoint, parts: list[dict] = PARTS, files: tuple[bytes, ...] | list[bytes] = (FIRST, SECOND)
) -> tuple[list[int], torch.Tensor]:
    """transformers' processor on a user message: its prompt ids and pixels."""
    processor = transformers.AutoProcessor.from_pretrained(str(checkpoint[0]))
    content = [{"type": "image"} if p["type"] == "image_url" else p for p in parts]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    images = [Image.open(io.BytesIO(f)) for f in files]
    out = processor(text=text, images=images, return_tensors="pt")
    return out["input_ids"][0].tolist(), out["pixel_values"]


def expected(family: str, checkpoint, dtype: str) -> list[int]:
    """float32: transformers' greedy tokens; bfloat16: one process's engine's (its logits
    follow transformers' bfloat16 ones: tests/services/model/test_deepseek_vl.py)."""
    ids, pixels = processed(checkpoint)
    if dtype == "float32":
        t = torch.tensor([ids])
        both_ways = {"token_type_ids": (t == FAMILIES[family][1]).long()}  # Gemma 3's images
        marks = both_ways if family == "gemma3" else {}
        with torch.no_grad():
            out = checkpoint[1].generate(
                t, pixel_values=pixels, attention_mask=torch.ones_like(t), **marks,
                max_new_tokens=ANSWER, do_sample=False, pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
        return out[0, len(ids) :].tolist()
    loaded = load_model(str(checkpoint[0]), dtype=dtype, device="cpu")
    assert loaded.encoder is not None
    digests = [loaded.encoder.digest(f) for f in (FIRST, SECOND)]
    _, image, tokens = FAMILIES[family]
    spans = image_spans(ids, image, tokens, digests)
    images = tuple(PromptImage(s, loaded.encoder.encode(f))
                   for s, f in zip(spans, (FIRST, SECOND), strict=True))  # fmt: skip
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=64))
    params = SamplingParams(max_tokens=ANSWER, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest("x", ids, params, images=images))
    seq = engine.requests["x"].seqs[0]
    while engine.has_unfinished:
        engine.step()
    return list(seq.output_ids)


def test_answers_through_encode_prefill_store_decode(stack):
    """The prompt the router makes is the processor's; the answer is the reference's, streamed
    or not; each image was encoded once, by the encoder, and read from the store."""
    family, dtype, checkpoint, client, encoders, prefill = stack
    want = expected(family, checkpoint, dtype)
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
    assert sum(load(e).images_encoded for e in encoders) == 2
    assert load(prefill).images_encoded == 0 and load(prefill).images_from_store >= 2


def test_an_encoder_killed_leaves_its_images_to_the_other(stack):
    """The encoder an image's bytes pick (rendezvous) killed before the request: its Encode
    fails, the image goes to the other encoder, which stores its rows for the prefill worker;
    the answer is the reference's."""
    family, dtype, checkpoint, client, encoders, prefill = stack
    if dtype != "float32" or family != "deepseek_vl":
        pytest.skip("one case suffices: which encoder takes an image is the router's doing")
    image = picture(21, (30, 50))
    chosen = pick(image, encoders)
    other = next(e for e in encoders if e is not chosen)
    before = load(other).images_encoded
    chosen.process.send_signal(signal.SIGKILL)
    chosen.process.wait()
    parts = [text_part("What is this? "), image_part(data_url(image))]
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": parts}],
        max_tokens=ANSWER, temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    ids, pixels = processed(checkpoint, parts, [image])
    t = torch.tensor([ids])
    with torch.no_grad():
        out = checkpoint[1].generate(
            t, pixel_values=pixels, attention_mask=torch.ones_like(t), max_new_tokens=ANSWER,
            do_sample=False, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint[0]))
    assert reply.choices[0].message.content == tokenizer.decode(out[0, len(ids) :].tolist())
    assert load(other).images_encoded == before + 1
    assert load(prefill).images_encoded == 0
