"""Reusing a chunk's KV away from the prefix it was computed after, approximately: the reference
of issue 55's mode, on dense tensors, for a Llama-shaped checkpoint (the embedded model).

A chunk (a document, a tool result) computed once in one prompt leaves its keys and values at
every layer. Placed at another position after other text, its keys are re-rotated to the new
positions (rotary angles add: R(a) R(b) = R(a + b)), and its values stand as they were: what
they miss is attention to the new text before them. CacheBlend's repair (Yao et al. 2024, as
LMCache implements it) recomputes a few tokens with the real context:

    layers below `check`: every token computed (their KV exact)
    layer `check`: every token's K, V computed; the reused tokens whose values deviate most
        from the reused ones (sum of squares over heads and dimensions) are chosen, `ratio`
        of them, with each chunk's first token always; the rest keep the reused KV
    layers above: only the chosen tokens and the tokens not reused are computed, attending
        to everything before them (reused KV where a token was not chosen)

`ratio` 1.0 is full recomputation (the same KV as `prefill`, up to summation order), 0.0 is
plain reuse with re-rotated keys. The engine's paged version is to equal this one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from services.model.loading.hf_config import read_config


@dataclass
class Cache:
    """A prompt's keys (rotated at their positions) and values at every layer, [T, kv, D]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def __len__(self) -> int:
        return len(self.keys[0])

    def slice(self, start: int, end: int) -> Cache:
        return Cache([k[start:end] for k in self.keys], [v[start:end] for v in self.values])


@dataclass(frozen=True)
class Reused:
    """A chunk's cache placed at `start` of the new prompt; it was computed at `was`."""

    start: int
    cache: Cache
    was: int


class Dense:
    """The checkpoint's decoder on dense float32 tensors, one sequence at a time."""

    def __init__(self, path: Path) -> None:
        c = read_config(path)
        self.config = c
        w = load_file(str(path / "model.safetensors"))
        self.w = {k: v.float() for k, v in w.items()}
        self.head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        d = c.head_dim
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self.scale = 1 / math.sqrt(d)

    # -- pieces ----------------------------------------------------------------------

    def rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.w[name]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary embedding (rotate-half) of x [T, H, D] at `positions` [T] (any integers:
        a negative one turns back)."""
        angles = positions.double()[:, None] * self.inv_freq[None]  # [T, D/2]
        cos = torch.cat([angles.cos(), angles.cos()], -1).float()[:, None]
        sin = torch.cat([angles.sin(), angles.sin()], -1).float()[:, None]
        half = x.shape[-1] // 2
        turned = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + turned * sin

    def qkv(self, i: int, h: torch.Tensor, positions: torch.Tensor):
        c, p = self.config, f"model.layers.{i}."
        x = self.rms(h, p + "input_layernorm.weight")
        a = p + "self_attn."
        q = (x @ self.w[a + "q_proj.weight"].T).view(len(h), c.num_heads, c.head_dim)
        k = (x @ self.w[a + "k_proj.weight"].T).view(len(h), c.num_kv_heads, c.head_dim)
        v = (x @ self.w[a + "v_proj.weight"].T).view(len(h), c.num_kv_heads, c.head_dim)
        return self.rotate(q, positions), self.rotate(k, positions), v

    def attend(
        self, q: torch.Tensor, at: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """Queries q [S, H, D] at positions `at` over the cache's first positions (keys and
        values [T, kv, D] at 0..T-1), causally: [S, H * D]."""
        group = self.config.num_heads // self.config.num_kv_heads
        k = keys.repeat_interleave(group, 1).transpose(0, 1)  # [H, T, D]
        v = values.repeat_interleave(group, 1).transpose(0, 1)
        scores = (q.transpose(0, 1) @ k.transpose(1, 2)) * self.scale  # [H, S, T]
        later = torch.arange(len(keys))[None, :] > at[:, None]
        scores = scores.masked_fill(later[None], float("-inf"))
        return (scores.softmax(-1) @ v).transpose(0, 1).reshape(len(q), -1)

    def finish_layer(self, i: int, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}."
        h = h + attended @ self.w[p + "self_attn.o_proj.weight"].T
        x = self.rms(h, p + "post_attention_layernorm.weight")
        m = p + "mlp."
        gate = torch.nn.functional.silu(x @ self.w[m + "gate_proj.weight"].T)
        return h + (gate * (x @ self.w[m + "up_proj.weight"].T)) @ self.w[m + "down_proj.weight"].T

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.rms(h, "model.norm.weight") @ self.head.T

    # -- whole passes ----------------------------------------------------------------

    def extend(self, cache: Cache | None, ids: list[int]) -> tuple[Cache, torch.Tensor]:
        """`ids` computed after the cache (None: a new prompt): the longer cache and the
        logits at each of them [len(ids), vocab]."""
        start = 0 if cache is None else len(cache)
        positions = torch.arange(start, start + len(ids))
        h = self.w["model.embed_tokens.weight"][torch.tensor(ids)]
        keys, values = [], []
        for i in range(self.config.num_layers):
            q, k, v = self.qkv(i, h, positions)
            if cache is not None:
                k, v = torch.cat([cache.keys[i], k]), torch.cat([cache.values[i], v])
            keys.append(k)
            values.append(v)
            h = self.finish_layer(i, h, self.attend(q, positions, k, v))
        return Cache(keys, values), self.logits(h)

    def blend(
        self, ids: list[int], reused: list[Reused], ratio: float, check: int = 1
    ) -> tuple[Cache, torch.Tensor, int]:
        """The prompt computed with the chunks' caches in place (re-rotated), `ratio` of their
        tokens recomputed from layer `check` on (CacheBlend's choice, above): its cache, the
        last token's logits, and how many reused tokens were recomputed."""
        n = len(ids)
        positions = torch.arange(n)
        reuse = torch.zeros(n, dtype=torch.bool)
        firsts = []
        for chunk in reused:
            end = chunk.start + len(chunk.cache)
            reuse[chunk.start : end] = True
            firsts.append(chunk.start)
        assert not reuse[-1], "the prompt's last token is computed (its logits are asked)"
        h = self.w["model.embed_tokens.weight"][torch.tensor(ids)]
        rows = torch.arange(n)  # the tokens computed at this layer
        keys, values = [], []
        for i in range(self.config.num_layers):
            q, k, v = self.qkv(i, h, positions[rows])
            if i >= check:
                full_k, full_v = self._placed(i, reused, n)
                if i == check:
                    rows = self._choose(v, full_v, reuse, firsts, ratio)
                    keep = torch.isin(torch.arange(n), rows)
                    q, k, v, h = q[keep], k[keep], v[keep], h[keep]
                full_k = full_k.clone()
                full_v = full_v.clone()
                full_k[rows], full_v[rows] = k, v
                # tokens not reused were never in a chunk: theirs are computed, always
                k, v = full_k, full_v
            keys.append(k)
            values.append(v)
            h = self.finish_layer(i, h, self.attend(q, positions[rows], k, v))
        recomputed = int((reuse & torch.isin(torch.arange(n), rows)).sum())
        return Cache(keys, values), self.logits(h[-1:])[0], recomputed

    def _placed(self, i: int, reused: list[Reused], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's reused keys (turned to their new positions) and values, zero elsewhere."""
        c = self.config
        k = torch.zeros(n, c.num_kv_heads, c.head_dim)
        v = torch.zeros(n, c.num_kv_heads, c.head_dim)
        for chunk in reused:
            end = chunk.start + len(chunk.cache)
            moved = torch.full((len(chunk.cache),), chunk.start - chunk.was)
            k[chunk.start : end] = self.rotate(chunk.cache.keys[i], moved)
            v[chunk.start : end] = chunk.cache.values[i]
        return k, v

    @staticmethod
    def _choose(
        new_v: torch.Tensor,
        old_v: torch.Tensor,
        reuse: torch.Tensor,
        firsts: list[int],
        ratio: float,
    ) -> torch.Tensor:
        """The rows computed from the check layer on: every token not reused, each chunk's
        first, and the `ratio` of the reused ones whose values deviate most."""
        deviation = (new_v - old_v).pow(2).sum((1, 2))
        deviation[~reuse] = float("inf")
        deviation[firsts] = float("inf")
        count = int((~reuse).sum()) + len(firsts) + round(ratio * int(reuse.sum()))
        count = min(count, len(reuse))
        return deviation.topk(count).indices.sort().values
