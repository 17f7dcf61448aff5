"""Tensor names and shapes shared by the checkpoint families (no torch: the router reads
configs too)."""

from __future__ import annotations


def embedding_shapes(vocab: int, hidden: int, tied: bool) -> dict[str, tuple[int, ...]]:
    """transformers' embedding, final norm and (untied) head."""
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes
