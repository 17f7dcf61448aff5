"""Static-batch generation straight on the model: the offline path of `pdserve generate`.

All prompts are prefilled in one pass, then decoded together until each stops. Each sequence
owns a contiguous run of blocks for its prompt plus max_tokens. The serving engine (scheduler,
block manager, full sampler) is built on the same forward pass; this is the minimal loop.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from services.model.batch import ForwardBatch, SeqChunk
from services.model.llama import LlamaModel


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()


def position_generator(seed: int, position: int) -> torch.Generator:
    """The random stream for the token at `position` of a request seeded `seed` (DESIGN.md)."""
    digest = hashlib.sha256(f"{seed}:{position}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def sample(logits: torch.Tensor, params: GenerationParams, position: int) -> int:
    # logits: [vocab] float32
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=position_generator(params.seed, position)))


def generate(
    model: LlamaModel,
    prompts: Sequence[Sequence[int]],
    params: GenerationParams,
    block_size: int = 16,
) -> list[list[int]]:
    """Generated token ids for each prompt (the stop token, when hit, is included)."""
    outputs: list[list[int]] = [[] for _ in prompts]
    for i, token in stream(model, prompts, params, block_size):
        outputs[i].append(token)
    return outputs


def stream(
    model: LlamaModel,
    prompts: Sequence[Sequence[int]],
    params: GenerationParams,
    block_size: int = 16,
) -> Iterator[tuple[int, int]]:
    """(prompt index, token) pairs as they are generated."""
    limit = model.config.max_model_len
    for p in prompts:
        if not p:
            raise ValueError("a prompt is empty")
        if len(p) + params.max_tokens > limit:
            raise ValueError(
                f"prompt ({len(p)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"the context window of {limit} tokens"
            )
    need = [-(-(len(p) + params.max_tokens) // block_size) for p in prompts]
    kv = model.new_kv_cache(sum(need), block_size)
    first = [sum(need[:i]) for i in range(len(prompts))]
    tables = [list(range(first[i], first[i] + need[i])) for i in range(len(prompts))]
    chunks = [SeqChunk(list(p), 0, tables[i]) for i, p in enumerate(prompts)]
    live = list(range(len(prompts)))
    lengths = [len(p) for p in prompts]  # tokens in the cache after this pass
    while live:
        logits = model.forward(ForwardBatch.build(chunks, block_size, model.device), kv)
        chunks, still = [], []
        for row, i in enumerate(live):
            token = sample(logits[row], params, lengths[i])
            yield i, token
            generated = lengths[i] + 1 - len(prompts[i])
            if token in params.stop_token_ids or generated >= params.max_tokens:
                continue
            chunks.append(SeqChunk([token], lengths[i], tables[i]))
            lengths[i] += 1
            still.append(i)
        live = still
