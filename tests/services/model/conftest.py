"""Fixtures for the model tests."""

from __future__ import annotations

import pytest
import torch
import transformers


@pytest.fixture(scope="session")
def tiny_llama():
    """A random two-layer Llama with the embedded model's vocabulary (GQA: 4 heads, 2 KV)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    )
    return transformers.LlamaForCausalLM(config).eval()
