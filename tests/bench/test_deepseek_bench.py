"""The DeepSeek benchmark runs end to end on a tiny shape and prints its four tables."""

from __future__ import annotations

from bench import deepseek

TINY = dict(
    deepseek.SHAPE,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=256,
)


def test_deepseek_benchmark_smoke(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(deepseek, "SHAPE", TINY)
    args = ["--dtypes", "float32", "--batches", "1,2", "--prompt-len", "20", "--context", "8",
            "--steps", "2", "--repeats", "1", "--expert-tokens", "1,5", "--mla-chunks", "16,40",
            "--checkpoint", str(tmp_path / "ckpt")]  # fmt: skip
    assert deepseek.main(args) == 0
    out = capsys.readouterr().out
    assert "| float32 | prefill 20 |" in out and "| float32 | decode b=2 |" in out
    assert "| 5 |" in out and "| 40 |" in out  # experts and MLA rows
    assert "| DeepSeek-V3, MLA latent | 576 | 70,272 |" in out
    assert "per-head / latent: 56.9x" in out
