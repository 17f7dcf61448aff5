"""Build a `tokenizers.Tokenizer` from a GGUF's byte-level BPE metadata.

A GGUF carries the vocabulary, the merges, each token's type and a pre-tokenizer name
(`tokenizer.ggml.pre`); the name stands for the regex that split text when the merges were
learned, as llama.cpp defines it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from services.model.errors import ModelLoadError

# llama.cpp token types
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pre-tokenizers whose merges were learned on single digits, then GPT-2's regex.
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva"}
_SPLIT_REGEX = {"llama-bpe": _LLAMA3, "llama3": _LLAMA3, "smaug-bpe": _LLAMA3, "qwen2": _QWEN2}


def tokenizer_from_gguf(path: Path, md: dict[str, Any]) -> Tokenizer:
    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            path,
            f"unsupported tokenizer model {kind!r} in the GGUF (only byte-level BPE, 'gpt2'); "
            "load the Hugging Face directory with its tokenizer.json instead",
        )
    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges") or ()]
    bpe = models.BPE(
        vocab={tok: i for i, tok in enumerate(tokens)},
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
    )
    tk = Tokenizer(bpe)
    tk.pre_tokenizer = _pre_tokenizer(path, str(md.get("tokenizer.ggml.pre", "gpt2")))
    tk.decoder = decoders.ByteLevel()
    types = md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    tk.add_tokens(
        [
            AddedToken(tok, special=types[i] == CONTROL, normalized=False)
            for i, tok in enumerate(tokens)
            if types[i] in (CONTROL, USER_DEFINED)
        ]
    )
    bos = md.get("tokenizer.ggml.bos_token_id")
    if md.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], int(bos))],
        )
    return tk


def _pre_tokenizer(path: Path, name: str) -> pre_tokenizers.PreTokenizer:
    if name in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if name in ("gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in _SPLIT_REGEX:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_REGEX[name]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ModelLoadError(path, f"unsupported pre-tokenizer {name!r} in the GGUF")
