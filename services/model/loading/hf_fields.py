"""Fields of a config.json that several families read alike (no torch: the router reads
configs too): end tokens, rope scaling, FP8 block scales."""

from __future__ import annotations

from typing import Any

from services.model.config import RopeScaling
from services.model.errors import ModelLoadError


def eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    return tuple(int(e) for e in (eos if isinstance(eos, list) else () if eos is None else [eos]))


def rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type") or raw.get("type")
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(raw["factor"]))
    if kind == "yarn":
        return RopeScaling(
            "yarn",
            float(raw["factor"]),
            original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
            beta_fast=float(raw.get("beta_fast") or 32.0),
            beta_slow=float(raw.get("beta_slow") or 1.0),
            mscale=float(raw.get("mscale") or 0.0),
            mscale_all_dim=float(raw.get("mscale_all_dim") or 0.0),
            attention_factor=optional_float(raw.get("attention_factor")),
            truncate=bool(raw.get("truncate", True)),
        )
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(raw["factor"]),
            float(raw.get("low_freq_factor", 1.0)),
            float(raw.get("high_freq_factor", 4.0)),
            int(raw.get("original_max_position_embeddings", 8192)),
        )
    raise ModelLoadError("config.json", f"unsupported rope_scaling type {kind!r}")


def optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def fp8_block(quantization: dict[str, Any] | None) -> tuple[int, int] | None:
    """The block shape of an FP8 checkpoint's weight scales (DeepSeek's 128 x 128), or None for
    an unquantized one. Other methods are refused by name."""
    if not quantization:
        return None
    method = quantization.get("quant_method")
    if method != "fp8":
        raise ModelLoadError(
            "config.json", f"unsupported quantization_config.quant_method={method!r} (fp8 only)"
        )
    if quantization.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(
            "config.json", f"unsupported quantization_config.fmt={quantization['fmt']!r}"
        )
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(int(b) > 0 for b in block)):
        raise ModelLoadError(
            "config.json",
            f"unsupported quantization_config.weight_block_size={block!r} (two block sides)",
        )
    return int(block[0]), int(block[1])
