"""Images through the whole service, as a user sends them with the `openai` client: a tiny
random Gemma 3 with its vision tower (made by transformers) served by an encode worker, a
prefill worker and two decode workers on a keyed Redis store, behind the router. The answers
equal transformers' token for token (encode -> store -> prefill -> store -> decode); the same
image reuses the prompt's blocks and another image never does (nor a block planted for one);
bad images are 400s naming the part while a bystander streams on; an encoder lost or a decode
worker killed mid-stream changes no answer."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import json
import signal
import threading
import time

import openai
import pytest
import redis
import torch
from PIL import Image
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from kvstore.block_hash import BLOCK_SIZE, block_hashes
from kvstore.keyfile import make_key
from kvstore.keys import store_key
from services.engine.images import image_spans
from services.launcher import RouterProcess, WorkerProcess, free_port
from services.model.loading.hf_config import read_config
from services.model.vision.images import Preprocess
from services.tokenizer.tokenizer import Tokenizer
from tests.support.cluster import load
from tests.support.redis_servers import RedisServer
from tests.support.tiny_vision import (
    BEGIN,
    END,
    IMAGE,
    TOKEN_TEXT,
    picture,
    save_tiny_gemma3_vision,
)

ANSWER = 10  # tokens each answer is long


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def image_part(url: str, **more: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **more}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, embedded_dir):
    path = tmp_path_factory.mktemp("gemma3-vision")
    return path, save_tiny_gemma3_vision(path, embedded_dir)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """A directory the router may read images from, also served over HTTP on 127.0.0.1."""
    root = tmp_path_factory.mktemp("media")
    (root / "local.png").write_bytes(picture(7, (36, 20)))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def stack(checkpoint, media, tmp_path_factory):
    path, _ = checkpoint
    logs = tmp_path_factory.mktemp("image-logs")
    store = RedisServer(logs / "redis").start()
    key = str(make_key(logs / "kv.key"))
    common = ("--kv-key-file", key)
    encode = WorkerProcess("encode", str(path), store.url, logs, *common, dtype="float32")
    blocks = ("--num-blocks", "256")
    prefill = WorkerProcess("prefill", str(path), store.url, logs, *common, *blocks,
                            dtype="float32")  # fmt: skip
    decode = [WorkerProcess("decode", str(path), store.url, logs, *common, *blocks,
                            dtype="float32") for _ in range(2)]  # fmt: skip
    workers = [encode, prefill, *decode]
    router = None
    try:
        for w in workers:
            w.launch()
        for w in workers:
            w.wait_ready()
        router = RouterProcess(
            logs, [prefill.address], [d.address for d in decode], f"--encode={encode.address}",
            "--allowed-local-media-path", str(media[0]), "--allowed-media-domains", "127.0.0.1",
            "--max-image-pixels", "1000000", "--max-images-per-request", "3",
            "--health-interval", "0.5", "--encode-timeout", "2", model=str(path),
        ).start()  # fmt: skip
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
        yield client, store, encode, prefill, decode
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()
        store.stop()


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return Tokenizer.from_dir(checkpoint[0])


def prompt_ids(tokenizer, parts: list[dict]) -> list[int]:
    """The prompt the router makes of one user message: the template's text, each image's
    begin token widened to its placeholders (Gemma 3's processor)."""
    pieces = []
    for p in parts:
        pieces.append(p["text"].strip() if p["type"] == "text" else TOKEN_TEXT[BEGIN])
    text = f"<|im_start|>user\n{''.join(pieces)}<|im_end|>\n<|im_start|>assistant\n"
    run = TOKEN_TEXT[IMAGE] * 16
    widened = f"\n\n{TOKEN_TEXT[BEGIN]}{run}{TOKEN_TEXT[END]}\n\n"
    return tokenizer.encode(text.replace(TOKEN_TEXT[BEGIN], widened), add_special_tokens=False)


def reference(checkpoint, tokenizer, parts: list[dict], files: list[bytes]) -> str:
    """transformers' greedy answer to the message, as text."""
    path, model = checkpoint
    ids = torch.tensor([prompt_ids(tokenizer, parts)])
    kwargs = {}
    if files:
        processor = Gemma3ImageProcessorPil.from_pretrained(str(path))
        images = [Image.open(io.BytesIO(f)) for f in files]
        kwargs = {"pixel_values": processor(images=images, return_tensors="pt")["pixel_values"],
                  "token_type_ids": (ids == IMAGE).long()}  # fmt: skip
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=ANSWER, do_sample=False,
            eos_token_id=None, pad_token_id=0, **kwargs,
        )  # fmt: skip
    return tokenizer.decode(out[0, ids.shape[1] :].tolist())


def ask(client, parts: list[dict], max_tokens: int = ANSWER, **more):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": parts}],
        max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}, **more,
    )  # fmt: skip


FIRST, SECOND = picture(1, (50, 70)), picture(2, (40, 30), "JPEG")


def test_answers_equal_transformers_through_encode_prefill_store_decode(
    stack, checkpoint, tokenizer
):
    """Two images (PNG, JPEG) encoded by the encoder, read from the store by the prefill
    worker, the prompt's blocks by a decode worker: transformers' tokens, streamed or not."""
    client, _, encode, prefill, _ = stack
    parts = [text_part("Compare "), image_part(data_url(FIRST)), text_part(" with "),
             image_part(data_url(SECOND, "jpeg")), text_part(" now")]  # fmt: skip
    expected = reference(checkpoint, tokenizer, parts, [FIRST, SECOND])
    reply = ask(client, parts)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(prompt_ids(tokenizer, parts))
    streamed = "".join(c.choices[0].delta.content or "" for c in ask(client, parts, stream=True)
                       if c.choices)  # fmt: skip
    assert streamed == expected
    assert load(encode).images_encoded == 2  # once each: the second time the store had them
    assert load(prefill).images_encoded == 0
    assert load(prefill).images_from_store >= 2


def test_responses_take_input_image(stack, checkpoint, tokenizer):
    client = stack[0]
    parts = [text_part("Describe "), image_part(data_url(FIRST))]
    reply = client.responses.create(
        model=client.models.list().data[0].id, max_output_tokens=ANSWER, temperature=0,
        input=[{"role": "user", "content": [
            {"type": "input_text", "text": "Describe "},
            {"type": "input_image", "image_url": data_url(FIRST), "detail": "low"}]}],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.output_text == reference(checkpoint, tokenizer, parts, [FIRST])


def stored_blocks(store, namespace: str, ids: list[int], spans) -> list[bool]:
    client = redis.Redis.from_url(store.url)
    hashes = block_hashes(ids, BLOCK_SIZE, namespace, b"", False, spans)
    return [bool(client.exists(store_key(namespace, h))) for h in hashes]


def spans_of(checkpoint, ids, files):
    vision = read_config(checkpoint[0]).vision
    settings = vision.preprocess.settings
    from kvstore.block_hash import image_digest

    digests = [image_digest(f, settings) for f in files]
    return image_spans(ids, IMAGE, 16, digests)


def two_images(tokenizer, text: str, seeds: tuple[int, int], size: tuple[int, int], tail: str):
    """Two messages alike but for their image: each (file, parts), and their prompt ids
    (the same tokens: only the image tells them apart)."""
    out = []
    for seed in seeds:
        data = picture(seed, size)
        out.append((data, [text_part(text), image_part(data_url(data)), text_part(tail)]))
    ids = prompt_ids(tokenizer, out[0][1])
    assert ids == prompt_ids(tokenizer, out[1][1])
    return out[0], out[1], ids


def test_the_same_image_shares_blocks_and_another_never(stack, checkpoint, tokenizer):
    """Same text, another image: the blocks before the image are shared, none from the
    image's first block on (their keys are the other image's); the same image again: every
    full block found."""
    client, store, _, prefill, _ = stack
    namespace = prefill_namespace(prefill)
    text = "A long enough opening so that whole blocks come before the picture: "
    (third, a), (fourth, b), ids = two_images(tokenizer, text, (3, 4), (33, 33), " what is it?")
    first_image_block = ids.index(IMAGE) // BLOCK_SIZE
    ask(client, a)
    assert all(stored_blocks(store, namespace, ids, spans_of(checkpoint, ids, [third])))
    before = stored_blocks(store, namespace, ids, spans_of(checkpoint, ids, [fourth]))
    assert before == [i < first_image_block for i in range(len(ids) // BLOCK_SIZE)]
    assert ask(client, b).choices[0].message.content == reference(
        checkpoint, tokenizer, b, [fourth]
    )
    again = ask(client, a)
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids) // BLOCK_SIZE * BLOCK_SIZE


def prefill_namespace(prefill) -> str:
    import asyncio

    import grpc

    from services.rpc import worker_pb2 as pb
    from services.rpc import worker_pb2_grpc as pbg

    async def ask_health() -> str:
        async with grpc.aio.insecure_channel(prefill.address) as channel:
            reply = await pbg.PrefillWorkerStub(channel).Health(pb.HealthRequest(), timeout=2)
            return str(reply.namespace)

    return asyncio.run(ask_health())


def test_a_block_planted_for_another_image_is_refused(stack, checkpoint, tokenizer):
    """The block holding image X, copied under the key of the same text with image Y (the
    store's writer could do that): the MAC binds a value to its block's hash, so the prefill
    worker refuses it (counted), computes the block, and answers Y's answer."""
    client, store, _, prefill, _ = stack
    namespace = prefill_namespace(prefill)
    text = "Another opening, again long enough for blocks ahead of it: "
    (x, with_x), (y, with_y), ids = two_images(tokenizer, text, (5, 6), (20, 20), " and?")
    ask(client, with_x)
    k = ids.index(IMAGE) // BLOCK_SIZE
    hx = block_hashes(ids, BLOCK_SIZE, namespace, b"", False, spans_of(checkpoint, ids, [x]))
    hy = block_hashes(ids, BLOCK_SIZE, namespace, b"", False, spans_of(checkpoint, ids, [y]))
    db = redis.Redis.from_url(store.url)
    db.set(store_key(namespace, hy[k]), db.get(store_key(namespace, hx[k])))
    corrupt = load(prefill).store_corrupt
    answer = ask(client, with_y).choices[0].message.content
    assert answer == reference(checkpoint, tokenizer, with_y, [y])
    assert load(prefill).store_corrupt == corrupt + 1


def truncated() -> str:
    return data_url(FIRST[: len(FIRST) // 2])


def bomb() -> str:
    """1,100 x 1,000 pixels of one color: a few kB, past the router's 1,000,000 pixels."""
    out = io.BytesIO()
    Image.new("RGB", (1100, 1000), (9, 9, 9)).save(out, "PNG")
    return data_url(out.getvalue())


BAD = [
    ([image_part("data:image/png;base64," + base64.b64encode(b"not an image").decode())],
     "messages.0.content.0.image_url", "not an image"),
    ([image_part(truncated())], "messages.0.content.0.image_url", "not a readable image"),
    ([image_part(bomb())], "messages.0.content.0.image_url", "1100x1000 pixels"),
    ([text_part("x"), image_part(data_url(FIRST), detail="ultra")],
     "messages.0.content.1.image_url.detail", "'auto', 'low' or 'high'"),
    ([image_part(data_url(FIRST))] * 4, "messages.0.content.3.image_url", "at most 3"),
    ([image_part("https://example.com/cat.png")], "messages.0.content.0.image_url",
     "remote image URLs are refused"),
    ([image_part("file:///etc/hostname")], "messages.0.content.0.image_url",
     "outside the allowed media directory"),
    ([image_part("data:image/png;base64,@@@")], "messages.0.content.0.image_url",
     "not valid base64"),
    ([text_part(TOKEN_TEXT[BEGIN]), image_part(data_url(FIRST))], "messages",
     "2 image places for 1 images"),
]  # fmt: skip


def test_bad_images_are_400s_naming_the_part_and_a_bystander_streams_on(stack):
    client = stack[0]
    alone = ask(client, [text_part("Tell me about lighthouses.")]).choices[0].message.content
    bystander = ask(client, [text_part("Tell me about lighthouses.")], stream=True)
    text = ""
    for i, chunk in enumerate(bystander):
        text += "".join(c.delta.content or "" for c in chunk.choices)
        if i == 2:
            for parts, param, phrase in BAD:
                with pytest.raises(openai.BadRequestError) as refused:
                    ask(client, parts)
                error = refused.value.body
                assert (error["param"], error["type"]) == (param, "invalid_request_error")
                assert phrase in error["message"], error
    assert text == alone


def test_local_files_and_allowed_remote_urls_read_the_same_image(stack, media, checkpoint):
    client = stack[0]
    root, base = media
    data = (root / "local.png").read_bytes()
    answers = {
        ask(client, [text_part("What is this? "), image_part(url)]).choices[0].message.content
        for url in (data_url(data), f"file://{root}/local.png", f"{base}/local.png")
    }
    assert len(answers) == 1


def test_pdserve_bench_random_mm_sends_images(stack, checkpoint, tmp_path):
    """`pdserve bench --workload random-mm`: 6 chats of 2 images each, a third of them an
    earlier request's: every request answered, each image's tokens in the server's count, and
    the encoder encodes each distinct image once."""
    from bench.load.cli import main as bench
    from bench.load.workloads import WorkloadConfig, build

    client, _, encode, _, _ = stack
    before = load(encode).images_encoded
    result = tmp_path / "run.json"
    code = bench([
        "--base-url", str(client.base_url).removesuffix("/v1/"), "--endpoint", "chat",
        "--workload", "random-mm", "--num-prompts", "6", "--images-per-request", "2",
        "--image-sizes", "40x30,64x64", "--image-repeat", "0.34", "--input-len", "8",
        "--output-len", "4", "--ignore-eos", "--tokenizer", str(checkpoint[0]),
        "--result-file", str(result), "--detailed", "--no-progress", "--seed", "2",
    ])  # fmt: skip
    assert code == 0
    run = json.loads(result.read_text())
    assert (run["completed"], run["failed"]) == (6, 0)
    # 8 text tokens, 2 x (16 placeholders + begin, end and their newlines), the template's
    assert all(r["input_tokens"] > 2 * 16 + 8 for r in run["requests"])
    sizes = ((40, 30), (64, 64))
    config = WorkloadConfig("random-mm", 6, 8, 4, images_per_request=2, image_sizes=sizes,
                            image_repeat=0.34, seed=2)  # fmt: skip
    distinct = {url for c in build(config, Tokenizer.from_dir(checkpoint[0])) for url in
                c.turns[0].images}  # fmt: skip
    assert 0 < len(distinct) < 12
    assert load(encode).images_encoded == before + len(distinct)


def test_a_decode_worker_killed_mid_stream_changes_nothing(stack, checkpoint, tokenizer):
    """The stream moves to the other decode worker, which reads the prompt's blocks (or
    computes them, the image's rows from the store): no gap, no duplicate."""
    client, _, _, _, decode = stack
    parts = [text_part("Once more: "), image_part(data_url(FIRST)), text_part(" go")]
    whole = ask(client, parts, max_tokens=40).choices[0].message.content
    text, killed = "", None
    for i, chunk in enumerate(ask(client, parts, max_tokens=40, stream=True)):
        text += "".join(c.delta.content or "" for c in chunk.choices)
        if i == 8:
            serving = [w for w in decode if w.process.poll() is None and load(w).running == 1]
            assert len(serving) == 1
            killed = serving[0]
            killed.process.send_signal(signal.SIGKILL)
            killed.process.wait()
    assert killed is not None
    assert text == whole


def test_an_encoder_that_hangs_then_dies_mid_request_changes_no_answer(
    stack, checkpoint, tokenizer
):
    """The encoder stopped (SIGSTOP): a request's Encode waits on it and passes the router's
    --encode-timeout (2 s), and the prefill worker encodes the image itself. Then, with a
    second request's Encode in flight to the stopped encoder, it is killed: the call fails at
    once and that image too is encoded by the prefill worker. Both answers are transformers'."""
    client, _, encode, prefill, _ = stack
    encode.process.send_signal(signal.SIGSTOP)
    try:
        hung = picture(8, (25, 45))
        parts = [text_part("And this one? "), image_part(data_url(hung))]
        encoded = load(prefill).images_encoded
        started = time.monotonic()
        reply = ask(client, parts)
        assert time.monotonic() - started >= 2.0  # the Encode's timeout passed first
        assert reply.choices[0].message.content == reference(checkpoint, tokenizer, parts, [hung])
        assert load(prefill).images_encoded == encoded + 1

        last = picture(9, (45, 25))
        parts = [text_part("And the last? "), image_part(data_url(last))]
        answer: list[str] = []
        asking = threading.Thread(target=lambda: answer.append(
            ask(client, parts).choices[0].message.content))  # fmt: skip
        asking.start()
        time.sleep(0.5)  # its Encode waits on the stopped encoder
        assert asking.is_alive()
    finally:
        encode.process.send_signal(signal.SIGKILL)
        encode.process.wait()
    asking.join(30)
    assert answer == [reference(checkpoint, tokenizer, parts, [last])]
    assert load(prefill).images_encoded == encoded + 2


def test_preprocessing_settings_name_the_image(checkpoint):
    """The digest covers the preprocessing: the same file made into other pixels is another
    image to every cache."""
    from kvstore.block_hash import image_digest

    vision = read_config(checkpoint[0]).vision
    other = Preprocess(64, 64, vision.preprocess.mean, vision.preprocess.std)
    assert image_digest(FIRST, vision.preprocess.settings) != image_digest(FIRST, other.settings)
