"""Prompt scoring (`prompt_logprobs`, echo with logprobs): the first choice of a request
computes its prompt with every row's logits returned, and each row scores the prompt's next
token (services/engine/engine.py skips the caches for it: its logits are needed)."""

from __future__ import annotations

import torch

from services.engine.request import Sequence
from services.engine.sampler import score_tokens
from services.engine.scheduler import ScheduledChunk


def scores_prompt(seq: Sequence) -> bool:
    """The sequence computes its prompt's logprobs: the first choice, before its first token."""
    return seq.params.prompt_logprobs is not None and seq.index == 0 and seq.num_output_tokens == 0


def score_prompts(chunks: list[ScheduledChunk], logits: torch.Tensor) -> torch.Tensor:
    """Record the prompt logprobs of chunks that return every row's logits; the rows left
    for sampling (the last row of each chunk that wants one)."""
    if not any(scores_prompt(c.seq) for c in chunks):
        return logits
    keep: list[int] = []
    row = 0
    for c in chunks:
        if not scores_prompt(c.seq):
            sampled = len(c.draft) + 1 if c.want_logits else 0
            keep += range(row, row + sampled)
            row += sampled
            continue
        seq = c.seq
        # row r holds the logits after position c.start + r: they score the next token
        scored = min(c.num_tokens, seq.prompt_len - 1 - c.start)
        if scored > 0:
            targets = seq.token_ids[c.start + 1 : c.start + 1 + scored]
            k = seq.params.prompt_logprobs or 0
            seq.prompt_logprobs += score_tokens(logits[row : row + scored], targets, k)
        row += c.num_tokens
        keep += [row - 1] if c.want_logits else []
    return logits[keep]
