"""A prompt whose images' rows are still being made (an encoder's: PromptImage.embeds None)
waits in the engine's queue (services/engine/scheduler.py) while the others run, on a tiny
random Gemma 3 with its vision tower: the engine has nothing to step while only such prompts
are left (its thread sleeps), the rows given (Engine.add_rows) let the prompt in, and its
tokens and logprobs are those of the same request given its rows at once; rows of other
images are refused, and a waiting request aborted leaves nothing behind."""

from __future__ import annotations

import dataclasses

import pytest

from services.engine.engine import Engine
from services.engine.params import SamplingParams, ValidationError
from services.engine.request import EngineRequest, Status
from services.model.loader import LoadedModel, load_model
from services.settings import EngineConfig
from tests.services.engine.test_images import FIRST, SECOND, TEXT, TOKEN_TEXT, prompt_images
from tests.support.tiny_vision import save_tiny_gemma3_vision


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, embedded_dir) -> LoadedModel:
    path = tmp_path_factory.mktemp("gemma3-vision")
    save_tiny_gemma3_vision(path, embedded_dir)
    return load_model(str(path), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def prompt(loaded) -> list[int]:
    assert loaded.config.vision is not None
    return loaded.tokenizer.encode(
        TEXT.format(image=loaded.config.vision.expansion(TOKEN_TEXT.__getitem__))
    )


LOGPROBS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)


def without_rows(images):
    return tuple(dataclasses.replace(i, embeds=None) for i in images)


def test_a_prompt_waits_for_its_rows_while_the_others_run(loaded, prompt):
    rows = prompt_images(prompt, [FIRST, SECOND], loaded)
    alone = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=64))
    alone.add_request(EngineRequest("image", prompt, LOGPROBS, images=rows))
    reference = alone.requests["image"].seqs[0]
    while alone.has_unfinished:
        alone.step()

    eng = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=64))
    eng.add_request(EngineRequest("image", prompt, LOGPROBS, images=without_rows(rows)))
    text = loaded.tokenizer.encode("A request of text alone, which must not wait")
    eng.add_request(EngineRequest("text", text, LOGPROBS))
    waiting, other = eng.requests["image"].seqs[0], eng.requests["text"].seqs[0]
    while other.status is not Status.FINISHED:
        eng.step()
    assert waiting.status is Status.WAITING and not waiting.block_ids
    assert eng.only_awaiting_rows and eng.step() == []
    with pytest.raises(ValidationError, match="rows for other images"):
        eng.add_rows("image", rows[:1])
    assert eng.add_rows("image", rows) and not eng.only_awaiting_rows
    while eng.has_unfinished:
        eng.step()
    assert waiting.output_ids == reference.output_ids
    assert waiting.logprobs == reference.logprobs
    assert not eng.add_rows("image", rows)  # finished: nothing to give rows to


def test_a_waiting_prompt_aborted_leaves_nothing(loaded, prompt):
    rows = prompt_images(prompt, [FIRST, SECOND], loaded)
    eng = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_blocks=64))
    free = eng.blocks.num_free
    eng.add_request(EngineRequest("image", prompt, LOGPROBS, images=without_rows(rows)))
    eng.step()
    eng.abort("image")
    assert not eng.has_unfinished and eng.blocks.num_free == free
    assert not eng.add_rows("image", rows)
    assert not eng.scheduler.waiting and not eng.scheduler.running
