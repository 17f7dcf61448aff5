"""Prompts with images through the engine (services/engine/images.py), on a tiny random
`Gemma3ForConditionalGeneration` (tests/support/tiny_vision.py) against transformers: greedy
tokens as transformers' whatever the chunk size (a chunk never ends inside an image, whose rows
attend both ways), bfloat16 logits near transformers' bfloat16 ones, results that do not depend
on the batch, prefix-cache reuse as far as the images allow (their digests are part of the
block hashes) and the images refused at the edge.

The prompt (75 tokens) puts its two images at 18..34 and 45..61: the first starts inside
block 1 and ends in block 2, which holds the start of the second, which ends in block 3.

    blocks:  | 0 text | 1 text, image 1 | 2 image 1, text, image 2 | 3 image 2, text | 4 text
"""

from __future__ import annotations

import io
from collections.abc import Sequence as Seq
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from kvstore.block_hash import ImageSpan, block_hashes
from services.engine.engine import Engine
from services.engine.images import PromptImage, image_spans
from services.engine.params import SamplingParams, ValidationError
from services.engine.request import EngineRequest, Sequence, TokenLogprobs
from services.model.batch import ForwardBatch, ImageRows, SeqChunk
from services.model.loader import LoadedModel, load_model
from services.model.vision.images import ImageLimits, open_image
from services.settings import EngineConfig
from tests.support.dtypes import COMPUTE_DTYPES
from tests.support.tiny_vision import (
    IMAGE,
    TOKEN_TEXT,
    TOKENS_PER_IMAGE,
    save_tiny_gemma3_vision,
)

TEXT = (
    "Here is a photograph that I took on my holiday last summer. Describe the picture{image}"
    "and compare it with this one{image}now please tell me what you see in both of them"
)
SPANS = ((18, 34), (45, 61))  # the images' placeholders in TEXT's tokens
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LOGPROBS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
Result = tuple[list[int], list[TokenLogprobs]]


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


FIRST, SECOND, THIRD = png(70, 50, seed=1), png(24, 40, seed=2), png(33, 61, seed=3)
ANY = ImageLimits(max_bytes=1 << 30, max_pixels=1 << 30)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, embedded_dir) -> tuple[Path, transformers.PreTrainedModel]:
    """(the tiny checkpoint's directory, transformers' model of it in float32)."""
    path = tmp_path_factory.mktemp("gemma3-vision")
    return path, save_tiny_gemma3_vision(path, embedded_dir)


@pytest.fixture(scope="module")
def models(checkpoint):
    """The checkpoint loaded in a dtype, once per dtype."""
    made: dict[str, LoadedModel] = {}

    def get(dtype: str) -> LoadedModel:
        if dtype not in made:
            made[dtype] = load_model(str(checkpoint[0]), dtype=dtype, device="cpu")
        return made[dtype]

    return get


@pytest.fixture(scope="module")
def loaded(models) -> LoadedModel:
    return models("float32")


@pytest.fixture(scope="module")
def processor(checkpoint) -> Gemma3ImageProcessorPil:
    return Gemma3ImageProcessorPil.from_pretrained(str(checkpoint[0]))


@pytest.fixture(scope="module")
def prompt(loaded) -> list[int]:
    """TEXT's tokens, its images where SPANS says (the tests below count blocks on it)."""
    image = loaded.config.vision.expansion(TOKEN_TEXT.__getitem__)
    ids = loaded.tokenizer.encode(TEXT.format(image=image))
    assert len(ids) == 75
    assert [(s.start, s.end) for s in spans(ids, [FIRST, SECOND], loaded)] == list(SPANS)
    return ids


@pytest.fixture(scope="module")
def expected(checkpoint, processor, prompt) -> list[int]:
    """transformers' 12 greedy tokens for the prompt with FIRST and SECOND."""
    out = reference_generate(checkpoint[1], processor, prompt, [FIRST, SECOND], max_new_tokens=12)
    return out.sequences[0, len(prompt) :].tolist()


def spans(ids: Seq[int], files: Seq[bytes], loaded: LoadedModel) -> tuple[ImageSpan, ...]:
    assert loaded.encoder is not None
    digests = [loaded.encoder.digest(f) for f in files]
    return image_spans(ids, IMAGE, TOKENS_PER_IMAGE, digests)


def prompt_images(ids: Seq[int], files: Seq[bytes], loaded: LoadedModel):
    """The images of a prompt as a worker hands them to the engine."""
    assert loaded.encoder is not None
    found = spans(ids, files, loaded)
    return tuple(
        PromptImage(s, loaded.encoder.encode(f)) for s, f in zip(found, files, strict=True)
    )


def request(rid: str, ids: Seq[int], files: Seq[bytes], loaded: LoadedModel, params):
    return EngineRequest(rid, list(ids), params, images=prompt_images(ids, files, loaded))


def engine(loaded: LoadedModel, chunk: int | None = None) -> Engine:
    """A fresh engine of 64 blocks; `chunk`: a prompt's tokens a step, at most (None: the
    default, 256 of 512 a step)."""
    budget = max(chunk, 64) if chunk else 512
    config = EngineConfig(num_blocks=64, prefill_chunk_size=chunk, max_num_batched_tokens=budget)
    return Engine(loaded.model, loaded.tokenizer, config)


def run(eng: Engine, *requests: EngineRequest) -> list[Sequence]:
    """The requests added at once, run to the end; their (first) sequences."""
    for r in requests:
        eng.add_request(r)
    seqs = [eng.requests[r.request_id].seqs[0] for r in requests]
    while eng.has_unfinished:
        eng.step()
    return seqs


def first_image_only(loaded: LoadedModel, prompt: list[int]) -> list[int]:
    """The prompt's first 40 tokens (its first image and 6 more), then a question of its own."""
    return prompt[:40] + loaded.tokenizer.encode(" Which of the two pictures is brighter?")


def result(seq: Sequence) -> Result:
    return seq.output_ids, list(seq.logprobs)


def reference_pixels(model, processor, files: Seq[bytes]) -> torch.Tensor:
    """transformers' pixels of the files [N, 3, 32, 32], in the model's dtype."""
    images = [open_image(f, ANY) for f in files]
    return processor(images=images, return_tensors="pt")["pixel_values"].to(model.dtype)


def reference_generate(model, processor, ids: Seq[int], files: Seq[bytes], **generate):
    """transformers' greedy generation, its image rows attending both ways (token_type_ids
    mark them)."""
    t = torch.tensor([list(ids)])
    with torch.no_grad():
        return model.generate(
            t, pixel_values=reference_pixels(model, processor, files),
            token_type_ids=(t == IMAGE).long(), attention_mask=torch.ones_like(t),
            do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True,
            **generate,
        )  # fmt: skip


def prompt_logits(loaded: LoadedModel, ids: Seq[int], files: Seq[bytes]) -> torch.Tensor:
    """The model's logits at every position of the prompt, computed in one chunk ([T, V],
    float32)."""
    rows = tuple(ImageRows(i.span.start, i.embeds, both_ways=True)
                 for i in prompt_images(ids, files, loaded))  # fmt: skip
    blocks = -(-len(ids) // 16)
    chunk = SeqChunk(list(ids), 0, list(range(blocks)), all_logits=True, images=rows)
    batch = ForwardBatch.build([chunk], 16)
    return loaded.model.forward(batch, loaded.model.new_kv_cache(blocks, 16)).float()


def reference_logits(model, processor, ids: Seq[int], files: Seq[bytes], both_ways: bool = True):
    """transformers' logits at every position ([T, V], float32); `both_ways`: its image rows
    attend both ways (token_type_ids mark them), else causally (none given)."""
    t = torch.tensor([list(ids)])
    pixels = reference_pixels(model, processor, files)
    marks = {"token_type_ids": (t == IMAGE).long()} if both_ways else {}
    with torch.no_grad():
        return model(t, pixel_values=pixels, **marks).logits[0].float()


@pytest.mark.parametrize("chunk", [512, 7, 16])
def test_greedy_tokens_equal_transformers(chunk, loaded, prompt, expected):
    """Two images of other sizes, 12 tokens, float32: transformers' tokens, the prompt whole or
    in chunks of 7 or 16 (each cut short before an image, or run on to its end)."""
    [seq] = run(engine(loaded, chunk), request("a", prompt, [FIRST, SECOND], loaded, GREEDY))
    assert seq.output_ids == expected


def test_image_rows_attend_both_ways(checkpoint, processor, loaded, prompt):
    """The tiny model tells both-ways attention from causal: on each image's first row
    transformers' causal logits (no token_type_ids) are over 0.1 from its both-ways ones; ours
    are within 1e-3 of the both-ways ones on every row (this model's float32 logits are
    ~2e-4 from transformers' on text alone: its norms are drawn large)."""
    both_ways = reference_logits(checkpoint[1], processor, prompt, [FIRST, SECOND])
    causal = reference_logits(checkpoint[1], processor, prompt, [FIRST, SECOND], both_ways=False)
    for start, _ in SPANS:
        assert (causal[start] - both_ways[start]).abs().max() > 0.1
    ours = prompt_logits(loaded, prompt, [FIRST, SECOND])
    assert (ours - both_ways).abs().max() <= 1e-3


@pytest.mark.parametrize("dtype", [d for d in COMPUTE_DTYPES if d.id == "bfloat16"])
def test_bfloat16_logits_follow_transformers(dtype, checkpoint, processor, models, prompt):
    """In bfloat16 both round differently: the first logits within 2e-2 of their scale of
    transformers' in bfloat16, the same first token."""
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        str(checkpoint[0]), dtype=torch.bfloat16
    ).eval()
    theirs = reference_logits(model, processor, prompt, [FIRST, SECOND])[-1]
    ours = prompt_logits(models(dtype), prompt, [FIRST, SECOND])[-1]
    assert (ours - theirs).abs().max() <= 2e-2 * theirs.abs().max() + 2e-2
    assert int(ours.argmax()) == int(theirs.argmax())


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
def test_results_do_not_depend_on_the_batch(dtype, models, prompt):
    """The image request's tokens and logprobs, bit for bit, alone or in one batch with a text
    request before it and another image request after it."""
    loaded = models(dtype)
    if not loaded.model.packed:
        pytest.skip("bitwise guarantees hold for oneDNN's products")
    [alone] = run(engine(loaded), request("a", prompt, [FIRST, SECOND], loaded, LOGPROBS))
    text = loaded.tokenizer.encode("A request of text alone, started with the others")
    other = first_image_only(loaded, prompt)
    together = run(
        engine(loaded),
        EngineRequest("text", text, LOGPROBS),
        request("a", prompt, [FIRST, SECOND], loaded, LOGPROBS),
        request("other", other, [THIRD], loaded, LOGPROBS),
    )
    assert len(alone.logprobs) == 8 and len(alone.logprobs[0].top) == 3
    assert result(together[1]) == result(alone)


def test_the_same_prompt_and_images_come_from_the_cache(loaded, prompt, expected):
    """Again on the same engine: every usable full block is found, both images included (the
    last token is always computed: 64 of 75), and the tokens are the same."""
    eng = engine(loaded)
    run(eng, request("first", prompt, [FIRST, SECOND], loaded, GREEDY))
    [again] = run(eng, request("again", prompt, [FIRST, SECOND], loaded, GREEDY))
    assert again.num_cached_tokens == 64 >= SPANS[1][1]
    assert again.output_ids == expected


@pytest.mark.parametrize(
    ("files", "cached"),
    [
        ((THIRD, SECOND), 16),  # block 1 holds the first image's start
        ((FIRST, THIRD), 32),  # block 2 holds the second's start (and the first's end)
    ],
    ids=["first-image-other", "second-image-other"],
)
def test_another_image_shares_only_the_blocks_before_it(files, cached, loaded, prompt):
    """The same text with one image changed: the blocks before the one holding the changed
    image's first placeholder come from the cache, no more; the tokens are those of an engine
    that computed it all."""
    eng = engine(loaded)
    run(eng, request("first", prompt, [FIRST, SECOND], loaded, GREEDY))
    [changed] = run(eng, request("changed", prompt, files, loaded, GREEDY))
    assert changed.num_cached_tokens == cached
    [fresh] = run(engine(loaded), request("fresh", prompt, files, loaded, GREEDY))
    assert fresh.num_cached_tokens == 0
    assert changed.output_ids == fresh.output_ids


def test_block_hashes_name_the_images(loaded, prompt):
    """The engine's hash chain over the prompt: with another first image, equal in block 0
    and different in every block from block 1 (the image's) on; with the images swapped, too
    (the same digests, in other places)."""
    namespace = engine(loaded).blocks.namespace

    def hashes(files: Seq[bytes]) -> list[bytes]:
        return block_hashes(prompt, 16, namespace, b"", images=spans(prompt, files, loaded))

    base = hashes([FIRST, SECOND])
    assert len(base) == 4
    for files in ([THIRD, SECOND], [SECOND, FIRST]):
        other = hashes(files)
        assert other[0] == base[0]
        assert all(a != b for a, b in zip(other[1:], base[1:], strict=True))
    assert block_hashes(prompt, 16, namespace)[0] == base[0]


def test_a_cache_hit_may_end_inside_an_image(checkpoint, processor, loaded, prompt):
    """A prompt sharing the text and first image up to token 40 finds blocks 0 and 1 cached
    and computes on from 32, inside the image (18..34), its rows there attending to those
    before in the cache and after in the chunk: transformers' tokens."""
    eng = engine(loaded, chunk=7)
    run(eng, request("first", prompt, [FIRST, SECOND], loaded, GREEDY))
    other = first_image_only(loaded, prompt)
    [seq] = run(eng, request("other", other, [FIRST], loaded, GREEDY))
    assert seq.num_cached_tokens == 32
    out = reference_generate(checkpoint[1], processor, other, [FIRST], max_new_tokens=12)
    assert seq.output_ids == out.sequences[0, len(other) :].tolist()


ROWS = (16, 64)  # an image's rows: one per placeholder, the model's width
# the images sent with the prompt, each (span, its rows' shape), given the prompt's two
# spans; the phrase each is refused with
WRONG = [
    pytest.param(lambda a, b: ((a, ROWS), (b, ROWS), (b, ROWS)), "image 2: positions 45..61",
                 id="three-for-two"),
    pytest.param(lambda a, b: ((b, ROWS), (a, ROWS)), "image 1: positions 18..34",
                 id="out-of-order"),
    pytest.param(lambda a, b: ((a, (16, 32)), (b, ROWS)), "image 0: embeddings (16, 32)",
                 id="narrow-rows"),
    pytest.param(lambda a, b: ((a, (15, 64)), (b, ROWS)), "image 0: embeddings (15, 64)",
                 id="a-row-short"),
    pytest.param(lambda a, b: ((ImageSpan(0, 16, a.digest), ROWS), (b, ROWS)),
                 "image 0: not all placeholder tokens", id="over-text"),
    pytest.param(lambda a, b: ((a, ROWS), (ImageSpan(70, 16, b.digest), ROWS)),
                 "image 1: positions 70..86", id="past-the-end"),
    pytest.param(lambda a, b: ((a, ROWS),), "do not cover the prompt's 2 image places",
                 id="one-for-two"),
    pytest.param(lambda a, b: ((ImageSpan(18, 8, a.digest), (8, 64)), (b, ROWS)),
                 "do not cover", id="half-a-run"),
]  # fmt: skip


@pytest.mark.parametrize(("images", "phrase"), WRONG)
def test_images_that_do_not_fit_the_prompt_are_refused(images, phrase, loaded, prompt):
    """ValidationError on field "images", with the reason, and nothing queued."""
    made = images(*spans(prompt, [FIRST, SECOND], loaded))
    sent = tuple(PromptImage(span, torch.zeros(shape)) for span, shape in made)
    eng = engine(loaded)
    with pytest.raises(ValidationError) as refused:
        eng.add_request(EngineRequest("wrong", prompt, GREEDY, images=sent))
    assert refused.value.field == "images"
    assert phrase in refused.value.message
    assert "wrong" not in eng.requests and not eng.has_unfinished


def test_a_text_model_refuses_images(tiny_dir):
    """Gemma 3's text decoder alone (Gemma3ForCausalLM) reads no images."""
    text_only = load_model(str(tiny_dir("gemma3")), dtype="float32", device="cpu")
    assert text_only.config.vision is None
    ids = list(range(100, 140))
    image = PromptImage(ImageSpan(10, 16, bytes(32)), torch.zeros(ROWS))
    eng = Engine(text_only.model, text_only.tokenizer, EngineConfig(num_blocks=16))
    with pytest.raises(ValidationError, match="the model reads no images") as refused:
        eng.add_request(EngineRequest("image", ids, GREEDY, images=(image,)))
    assert refused.value.field == "images"
    eng.add_request(EngineRequest("text", ids, GREEDY))  # the same prompt without is taken
