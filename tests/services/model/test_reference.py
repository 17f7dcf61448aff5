"""Greedy generation matches transformers token for token (float32, same weights)."""

from __future__ import annotations

import torch

from services.engine.engine import Engine, EngineConfig
from services.engine.params import SamplingParams

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n",
    "Once upon a time in 1999,",
    "The three primary colors are",
    "Translate to French: I would like a cup of coffee.",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "Les montagnes des Alpes sont",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "🙂 Emoji and ünïcödé: ",
]
NEW_TOKENS = 32


def test_greedy_matches_transformers(embedded, reference):
    prompts = [embedded.tokenizer.encode(p) for p in PROMPTS]
    # all prompts in one batch: batching must not change a single token
    engine = Engine(embedded.model, embedded.tokenizer, EngineConfig(num_blocks=100))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    ours = [out.choices[0].token_ids for out in engine.generate(prompts, params)]
    for prompt, text, got in zip(prompts, PROMPTS, ours, strict=True):
        with torch.inference_mode():
            out = reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        expected = out[0, len(prompt) :].tolist()
        assert got == expected, f"diverged for {text!r}"
    assert all(len(g) == NEW_TOKENS for g in ours)


def test_prefill_logits_match_transformers(embedded, reference):
    ids = embedded.tokenizer.encode("A paged KV cache stores keys and values in blocks.")
    from services.model.batch import ForwardBatch, SeqChunk

    kv = embedded.model.new_kv_cache(4, 16)
    batch = ForwardBatch.build([SeqChunk(ids, 0, [3, 1, 0, 2])], 16)
    ours = embedded.model.forward(batch, kv)[0]
    with torch.inference_mode():
        theirs = reference(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0)
