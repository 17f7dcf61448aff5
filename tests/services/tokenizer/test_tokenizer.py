"""Tokenizer and chat template agree with transformers; detokenization is incremental."""

from __future__ import annotations

import pytest
import transformers

from services.model.loading import sources
from services.tokenizer.chat import ChatTemplate, ChatTemplateError
from services.tokenizer.tokenizer import Tokenizer

CONVERSATION = [
    {"role": "user", "content": "I have 3 cats and 12 fish. How many legs in total?"},
    {"role": "assistant", "content": "Cats have 4 legs each, so 3 × 4 = 12 legs; fish have none."},
    {"role": "user", "content": "Merci ! Et si j'adopte un chien 🐕 ?"},
]
TEXTS = [
    "Hello, world!",
    "In 2024, I paid $1,234.56 for 3 apples.",
    "def f(x):\n\treturn x ** 2  # square\n\n\n",
    "   leading and trailing spaces   ",
    "Ünïcödé, 日本語のテキスト, emoji 🙂🚀 and Ελληνικά.",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "it's they're we'll I'd you've",
]


@pytest.fixture(scope="module")
def ours(embedded_dir) -> Tokenizer:
    return Tokenizer.from_dir(embedded_dir)


@pytest.fixture(scope="module")
def hf_from_gguf():
    """transformers' own reading of the GGUF's tokenizer metadata: an independent reference."""
    path = sources.embedded_gguf()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def hf_from_dir(embedded_dir):
    """What a peer (vLLM, transformers) loads from the converted directory."""
    return transformers.AutoTokenizer.from_pretrained(embedded_dir)


def _ids(out) -> list[int]:
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("reference", ["hf_from_gguf", "hf_from_dir"])
def test_chat_prompt_and_ids_equal_transformers(ours, reference, request):
    hf = request.getfixturevalue(reference)
    text = hf.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(CONVERSATION) == text
    ids = hf.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
    assert ours.encode_chat(CONVERSATION) == _ids(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_equals_transformers_gguf_tokenizer(ours, hf_from_gguf, text):
    assert ours.encode(text) == hf_from_gguf.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_digits_are_split_one_by_one(ours):
    """SmolLM2 was trained on single digits (llama.cpp's "smollm" pre-tokenizer)."""
    assert [ours.decode([i]) for i in ours.encode("2024")] == ["2", "0", "2", "4"]


def test_special_tokens(ours):
    assert ours.encode("<|im_start|><|im_end|>") == [1, 2]
    assert ours.special_ids >= {0, 1, 2}
    assert ours.decode([1, 28120, 2]) == ours.decode([28120])


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenization_never_splits_a_character(ours, text):
    ids = ours.encode(text)
    detok = ours.detokenizer(prompt_ids=ours.encode("Prompt:"), skip_special_tokens=False)
    pieces = [detok.add([i]) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text == detok.text
    assert not any("\ufffd" in p for p in pieces)


def test_multibyte_character_spread_over_tokens_waits_until_complete(ours):
    ids = ours.encode("🐕")
    assert len(ids) > 1  # byte-level BPE splits this emoji
    detok = ours.detokenizer()
    assert [detok.add([i]) for i in ids] == [""] * (len(ids) - 1) + ["🐕"]


def test_template_runs_sandboxed():
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        evil.render([{"role": "user", "content": "x"}])


def test_template_can_refuse_input():
    t = ChatTemplate("{% if messages|length > 1 %}{{ raise_exception('one only') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="one only"):
        t.render([{"role": "user", "content": "a"}] * 2)
