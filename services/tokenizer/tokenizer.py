"""The tokenizer every service uses: a `tokenizers` backend, the chat template, special ids."""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers

from services.model.errors import ModelLoadError, read_json_object
from services.tokenizer.chat import ChatTemplate
from services.tokenizer.detokenize import IncrementalDetokenizer


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = (
            ChatTemplate(chat_template, bos_token or "", eos_token or "") if chat_template else None
        )

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """Load tokenizer.json plus the template and special tokens of tokenizer_config.json."""
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(path, "no tokenizer.json in the model directory")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:
            raise ModelLoadError(file, f"not a valid tokenizer.json: {e}") from e
        cfg_file = path / "tokenizer_config.json"
        cfg = read_json_object(cfg_file) if cfg_file.is_file() else {}
        template = cfg.get("chat_template")
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(
            backend, template, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        )

    def save(self, path: Path, model_max_length: int) -> None:
        """Write tokenizer.json, tokenizer_config.json and chat_template.jinja to `path`."""
        self.backend.save(str(path / "tokenizer.json"))
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": False,
            "add_bos_token": False,
            "add_eos_token": False,
        }
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template.source
            (path / "chat_template.jinja").write_text(self.chat_template.source)
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        special = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token))}
        (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_marked(
        self, text: str, marks: Sequence[tuple[int, int]], add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode`'s ids, and for each span [a, b) of characters in `marks` the tokens lying
        wholly inside it, [first, end) (a span holding none is left out)."""
        encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        offsets = encoding.offsets
        spans = []
        for a, b in marks:
            inside = [i for i, (s, e) in enumerate(offsets) if a <= s and e <= b and s < e]
            if inside:
                spans.append((inside[0], inside[-1] + 1))
        return list(encoding.ids), spans

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str:
        """A token's text as the vocabulary spells it (a special token's name)."""
        out = self.backend.id_to_token(token_id)
        if out is None:
            raise ValueError(f"token {token_id} is not in the vocabulary")
        return str(out)

    def token_to_id(self, token: str) -> int | None:
        out = self.backend.token_to_id(token)
        return None if out is None else int(out)

    @property
    def template_has_tools(self) -> bool:
        """The chat template renders a `tools` list itself (else the router writes them)."""
        return self.chat_template is not None and "tools" in self.chat_template.source

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        extra = {} if tools is None else {"tools": list(tools)}
        return self.chat_template.render(
            messages, add_generation_prompt=add_generation_prompt, **extra
        )

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the rendered conversation; the template supplies any BOS itself."""
        text = self.render_chat(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False)

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            lambda ids: self.decode(ids, skip_special_tokens=skip_special_tokens), prompt_ids
        )


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json gives it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value.get("content"))
    return None if value is None else str(value)
