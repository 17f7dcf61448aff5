"""Both vision families through the whole service in every dtype `--dtype auto` picks here, as
a user sends them with the `openai` client: tiny random checkpoints made by transformers
(DeepSeek-VL on a DeepSeek-V3 decoder, tests/support/tiny_deepseek_vl.py; Gemma 3,
tests/support/tiny_vision.py) served by two encode workers, a prefill worker and two decode
workers on a Redis store, behind the router.

    cold       encode -> store -> prefill -> store -> decode: the text and every token's
               logprob those of one process's engine (bit for bit), and in float32 the tokens
               transformers' from its own processor's prompt and pixels
    warm       the same again: the prompt's blocks cached, the same text and logprobs
    migrated   the decode worker serving the stream SIGKILLed mid-stream: the same again
    encoder    the encoder an image picks killed: the other encodes it

Each image is encoded once, by an encoder. (Gemma 3 in float32, with the other faults:
test_images_e2e.py.)"""

from __future__ import annotations

import dataclasses
import functools
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

ANSWER = 16
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
    encoders = [WorkerProcess("encode", path, store.url, logs, dtype=dtype) for _ in range(2)]
    prefill = WorkerProcess("prefill", path, store.url, logs, *common, dtype=dtype)
    decode = [WorkerProcess("decode", path, store.url, logs, *common, dtype=dtype)
              for _ in range(2)]  # fmt: skip
    workers = [*encoders, prefill, *decode]
    router = None
    try:
        for w in workers:
            w.launch()
        for w in workers:
            w.wait_ready()
        router = RouterProcess(
            logs, [prefill.address], [d.address for d in decode],
            f"--encode={','.join(e.address for e in encoders)}", "--health-interval", "0.5",
            model=path,
        ).start()  # fmt: skip
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
        yield Stack(family, dtype, checkpoint, client, encoders, prefill, decode)
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()
        store.stop()


@dataclasses.dataclass
class Stack:
    family: str
    dtype: str
    checkpoint: tuple
    client: openai.OpenAI
    encoders: list[WorkerProcess]
    prefill: WorkerProcess
    decode: list[WorkerProcess]


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


def transformers_tokens(stack: Stack, parts: list[dict], files: list[bytes]) -> list[int]:
    """transformers' greedy tokens (float32) on its processor's prompt and pixels."""
    ids, pixels = processed(stack.checkpoint, parts, files)
    t = torch.tensor([ids])
    both_ways = {"token_type_ids": (t == FAMILIES[stack.family][1]).long()}  # Gemma 3's images
    marks = both_ways if stack.family == "gemma3" else {}
    with torch.no_grad():
        out = stack.checkpoint[1].generate(
            t, pixel_values=pixels, attention_mask=torch.ones_like(t), **marks,
            max_new_tokens=ANSWER, do_sample=False, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


@functools.cache
def one_process(family: str, path: str, dtype: str) -> tuple[list[int], str, list[float]]:
    """The in-process engine's greedy answer to PARTS in `dtype`: tokens, text, logprobs."""
    ids, _ = processed((path,))
    loaded = load_model(path, dtype=dtype, device="cpu")
    assert loaded.encoder is not None
    digests = [loaded.encoder.digest(f) for f in (FIRST, SECOND)]
    _, image, tokens = FAMILIES[family]
    spans = image_spans(ids, image, tokens, digests)
    images = tuple(PromptImage(s, loaded.encoder.encode(f))
                   for s, f in zip(spans, (FIRST, SECOND), strict=True))  # fmt: skip
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=64))
    params = SamplingParams(max_tokens=ANSWER, temperature=0, ignore_eos=True, logprobs=1)
    engine.add_request(EngineRequest("x", ids, params, images=images))
    seq = engine.requests["x"].seqs[0]
    while engine.has_unfinished:
        engine.step()
    return list(seq.output_ids), seq.text, [lp.logprob for lp in seq.logprobs]


def chat(stack: Stack, parts: list[dict] = PARTS, at: int = -1, act=lambda: None):
    """The answer streamed (text, logprobs, usage); `act` runs after chunk `at`."""
    text, logprobs, usage = "", [], None
    stream = stack.client.chat.completions.create(
        model=stack.client.models.list().data[0].id, max_tokens=ANSWER, temperature=0,
        messages=[{"role": "user", "content": parts}], logprobs=True, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, chunk in enumerate(stream):
        for c in chunk.choices:
            text += c.delta.content or ""
            logprobs += [t.logprob for t in (c.logprobs.content or [])] if c.logprobs else []
        usage = chunk.usage or usage
        if i == at:
            act()
    return text, logprobs, usage


def test_cold_and_warm_answers_are_one_process_bits(stack):
    """Cold: the prompt the router makes is the processor's; the text and logprobs are one
    process's engine's, bit for bit (and in float32 the tokens transformers'); each image
    encoded once, by an encoder, read from the store by the prefill worker. Warm: the same
    again from the prompt's cached blocks."""
    tokens, text, logprobs = one_process(stack.family, str(stack.checkpoint[0]), stack.dtype)
    if stack.dtype == "float32":
        assert tokens == transformers_tokens(stack, PARTS, [FIRST, SECOND])
    cold = chat(stack)
    prompt = len(processed(stack.checkpoint)[0])
    assert cold[:2] == (text, logprobs) and len(logprobs) == ANSWER
    assert cold[2].prompt_tokens == prompt
    warm = chat(stack)
    assert warm[:2] == (text, logprobs)
    assert warm[2].prompt_tokens_details.cached_tokens == (prompt - 1) // 16 * 16
    assert sum(load(e).images_encoded for e in stack.encoders) == 2
    p = load(stack.prefill)
    assert p.images_encoded == 0 and p.images_from_store >= 2


def test_an_encoder_killed_leaves_its_images_to_the_other(stack):
    """The encoder an image's bytes pick (rendezvous) killed before the request: its Encode
    fails, the image goes to the other encoder, which stores its rows for the prefill worker;
    the answer is transformers'."""
    if stack.dtype != "float32" or stack.family != "deepseek_vl":
        pytest.skip("one case suffices: which encoder takes an image is the router's doing")
    image = picture(21, (30, 50))
    chosen = pick(image, stack.encoders)
    other = next(e for e in stack.encoders if e is not chosen)
    before = load(other).images_encoded
    chosen.process.send_signal(signal.SIGKILL)
    chosen.process.wait()
    parts = [text_part("What is this? "), image_part(data_url(image))]
    text, _, _ = chat(stack, parts)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(stack.checkpoint[0]))
    assert text == tokenizer.decode(transformers_tokens(stack, parts, [image]))
    assert load(other).images_encoded == before + 1
    assert load(stack.prefill).images_encoded == 0


def test_a_decode_worker_killed_mid_stream_changes_no_bit(stack):
    """The stream moves to the other decode worker, which continues from the prompt's blocks
    in the store: the same text and logprobs as one process."""
    _, text, logprobs = one_process(stack.family, str(stack.checkpoint[0]), stack.dtype)
    killed = []

    def kill() -> None:
        serving = [w for w in stack.decode if load(w).running == 1]
        assert len(serving) == 1
        serving[0].process.send_signal(signal.SIGKILL)
        serving[0].process.wait()
        killed.append(serving[0])

    assert chat(stack, at=5, act=kill)[:2] == (text, logprobs)
    assert killed
