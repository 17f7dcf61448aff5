"""What images cost: the encoder's throughput, TTFT with the encoder cache hit against missed,
and the encode hop (`--num-encode 1`) against the worker encoding its prompt's images itself.

    python -m bench.images [--requests 8] [--dtype auto] [--disaggregated] [--json F]

The model: a random Gemma 3 made with transformers (no weights to download): a ViT-B-sized
SigLIP tower (12 layers, hidden 768) over 448 x 448 images in 14 x 14 patches (1,024), pooled
to 256 rows an image, and an 8-layer text decoder of SmolLM2's width. Images of random pixels.

1. The encoder alone, in this process: images/s and ms an image (decode, resize, tower).
2. `pdserve up` colocated, then colocated with one encode worker: per topology, `requests`
   chats, one at a time, each with its own text before the image (no prefix reuse): a new
   image each (the encoder cache misses), then the same image each (it hits). Reported: TTFT
   median and p90 (streamed, first content chunk), and the hop's cost as the difference of
   the misses' medians between the two topologies. `--disaggregated`: a prefill and a decode
   worker instead of one colocated worker (the prefill worker encodes, or queues the prompt
   while the encode worker makes its rows).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import openai
import torch
from PIL import Image

from services.launcher import free_port
from services.model.loader import load_encoder
from services.model.loading.sources import EMBEDDED, resolve
from tests.support.tiny_vision import BEGIN, END, IMAGE
from tests.support.up import Up

TEXT = dict(vocab_size=49160, hidden_size=576, intermediate_size=1536, num_hidden_layers=8,
            num_attention_heads=9, num_key_value_heads=3, head_dim=64, sliding_window=512,
            query_pre_attn_scalar=64, max_position_embeddings=4096)  # fmt: skip
ANSWER = 8  # tokens each answer is long
SEED = 100  # the images of the runs: the same for every server
NAMES = {0: "the worker encodes", 1: "+ 1 encode worker"}
VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, image_size=448, patch_size=14,
              vision_use_head=False)  # fmt: skip


def save_model(path: Path) -> Path:
    """The benchmark's random Gemma 3 with its vision tower (tests/support/tiny_vision.py's
    tokenizer, template and processor settings, at this size)."""
    import transformers

    from tests.support import tiny_vision

    config = transformers.Gemma3Config(
        text_config=TEXT, vision_config=VISION, mm_tokens_per_image=256,
        boi_token_index=BEGIN, eoi_token_index=END, image_token_index=IMAGE,
    )  # fmt: skip
    tiny_vision.save_tiny_gemma3_vision(path, resolve(EMBEDDED), config=config)
    add_newline_tokens(path)
    tower_names_as_vllm_reads_them(path)
    return path


def tower_names_as_vllm_reads_them(path: Path) -> None:
    """`vision_tower.vision_model.*`, as transformers 4 saved the tower (vLLM 0.32 reads only
    that; pdserve reads both)."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    renamed = {
        n.replace("vision_tower.", "vision_tower.vision_model.", 1)
        if n.startswith("vision_tower.") else n: t
        for n, t in tensors.items()
    }  # fmt: skip
    save_file(renamed, str(file), metadata={"format": "pt"})


def add_newline_tokens(path: Path) -> None:
    """Runs of 1-4 newlines as tokens of their own, as Gemma's vocabulary has them: vLLM's
    Gemma 3 looks them up by text when it places an image (ids 49155-49158, inside the
    vocabulary; both servers then tokenize newlines alike)."""
    file = path / "tokenizer.json"
    tokenizer = json.loads(file.read_text())
    flags = dict.fromkeys(("single_word", "lstrip", "rstrip", "normalized", "special"), False)
    for i in range(1, 5):
        tokenizer["added_tokens"].append({"id": IMAGE + i, "content": "\n" * i, **flags})
    file.write_text(json.dumps(tokenizer))


def png(seed: int, size: tuple[int, int] = (640, 480)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def encoder_rate(path: Path, dtype: str, images: int) -> dict[str, float]:
    encoder, _, _ = load_encoder(str(path), dtype, "cpu")
    files = [png(1000 + i) for i in range(images + 1)]
    encoder.encode(files[-1])  # warm
    start = time.perf_counter()
    for data in files[:images]:
        encoder.encode(data)
    seconds = time.perf_counter() - start
    return {"images_per_s": images / seconds, "ms_per_image": 1000 * seconds / images}


def ask(client: openai.OpenAI, model: str, text: str, image: bytes) -> tuple[float, str]:
    """TTFT in ms (the first content chunk, streamed) and the greedy answer's text."""
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content: Any = [{"type": "text", "text": text},
                    {"type": "image_url", "image_url": {"url": url}}]  # fmt: skip
    start = time.perf_counter()
    stream: Any = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=ANSWER,
        temperature=0, stream=True,
    )  # fmt: skip
    first, answer = None, ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content is not None:
            first = first or time.perf_counter()
            answer += chunk.choices[0].delta.content
    assert first is not None
    return 1000 * (first - start), answer


def measure(base_url: str, requests: int, seed: int) -> dict[str, Any]:
    """One server: a warm-up, then `requests` new images (the encoder cache misses), then
    `requests` times one image seen once before (it hits), each after text of its own."""
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    ask(client, model, "warm up", png(seed - 1))
    same = png(seed + 10_000)
    ask(client, model, "first sight of the repeated image", same)
    miss = [ask(client, model, f"request {seed + i}:", png(seed + i)) for i in range(requests)]
    hit = [ask(client, model, f"again {seed + i}:", same) for i in range(requests)]
    return {"miss_ms": summary([t for t, _ in miss]), "hit_ms": summary([t for t, _ in hit]),
            "answers": [a for _, a in miss]}  # fmt: skip


def topology(path: Path, dtype: str, encoders: int, requests: int, split: bool) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-images-"))
    workers = ("--no-colocated", "--num-prefill", "1", "--num-decode", "1") if split else ()
    up = Up("--port", str(free_port()), "--model", str(path), "--dtype", dtype,
            "--kv-store", f"local://{work}/kv", "--num-encode", str(encoders),
            *workers)  # fmt: skip
    name = f"pdserve, {'prefill + decode' if split else 'colocated'}: {NAMES[encoders]}"
    try:
        return {"name": name} | measure(up.ready(), requests, SEED)
    finally:
        up.stop()


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": statistics.median(ordered),
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]}  # fmt: skip


def machine() -> str:
    name = platform.processor() or platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
            break
    return f"{name}, {torch.get_num_threads()} threads"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--images", type=int, default=8, help="images through the encoder alone")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--save-model", type=Path, help="only write the model here (for vLLM)")
    p.add_argument("--vllm", help="base URL of a vLLM serving --save-model's directory: "
                   "measured instead of pdserve")  # fmt: skip
    p.add_argument("--disaggregated", action="store_true",
                   help="a prefill and a decode worker, not one colocated worker")  # fmt: skip
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.save_model:
        save_model(args.save_model)
        return
    out: dict[str, Any] = {"machine": machine(), "dtype": args.dtype}
    if args.vllm:
        out["topologies"] = [{"name": "vLLM-cpu"} | measure(args.vllm, args.requests, SEED)]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = save_model(Path(tmp) / "model")
            out["encoder"] = encoder_rate(path, args.dtype, args.images)
            print(f"encoder alone: {out['encoder']['images_per_s']:.2f} images/s "
                  f"({out['encoder']['ms_per_image']:.0f} ms an image)")  # fmt: skip
            out["topologies"] = [
                topology(path, args.dtype, encoders, args.requests, args.disaggregated)
                for encoders in (0, 1)
            ]
    print(table(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


def table(out: dict[str, Any]) -> str:
    rows = ["| server | TTFT, new image (median / p90 ms) | TTFT, repeated image | hit saves |",
            "| --- | --- | --- | --- |"]  # fmt: skip
    for t in out["topologies"]:
        miss, hit = t["miss_ms"], t["hit_ms"]
        rows.append(f"| {t['name']} | {miss['median']:.0f} / {miss['p90']:.0f} | "
                    f"{hit['median']:.0f} / {hit['p90']:.0f} | "
                    f"{miss['median'] - hit['median']:.0f} ms |")  # fmt: skip
    if len(out["topologies"]) == 2:
        local, hop = (t["miss_ms"]["median"] for t in out["topologies"])
        rows.append(f"\nthe encode hop: {hop - local:+.0f} ms of TTFT on a new image")
    rows.append(f"({out['machine']}, {out['dtype']})")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
