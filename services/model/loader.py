"""Load a model by name: weights, tokenizer and config, on the chosen device and dtype."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from services.model import families
from services.model.causal_lm import CausalLM, MtpLayer
from services.model.config import ModelConfig
from services.model.errors import ModelLoadError
from services.model.experts.eplb import Share
from services.model.layers.attention import resolve_kernels
from services.model.loading import hf_config, hf_dir, quantize, sources
from services.model.parallel.plan import slices
from services.model.parallel.tensor import sliced
from services.model.vision.encoder import ImageEncoder, build_encoder
from services.settings import DEFAULTS
from services.tokenizer.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer
    path: Path  # the Hugging Face directory the weights came from
    whole: ModelConfig | None = None  # the checkpoint's config, where the model is a slice
    encoder: ImageEncoder | None = None  # a model that reads images: its image encoder

    @property
    def config(self) -> ModelConfig:
        """The checkpoint's config (a tensor-parallel rank's model holds its heads' only)."""
        return self.whole or self.model.config


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_bf16_units() -> bool:
    """AVX512-BF16 or AMX: with either, oneDNN's bf16 matmuls run ~2x float32's speed here;
    without, torch emulates bf16 at well under 1% of float32's speed."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on GPUs and on CPUs with bf16 units, float32 elsewhere."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r} (choose auto, {', '.join(DTYPES)})")
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_bf16_units() else torch.float32


def load_model(
    spec: str = sources.EMBEDDED,
    dtype: str = DEFAULTS.model.dtype,
    device: str = DEFAULTS.model.device,
    quantization: str = DEFAULTS.model.quantization,
    kernels: str = DEFAULTS.model.kernels,
    deterministic: bool = DEFAULTS.model.deterministic,
    tensor: tuple[int, int] = (0, 1),
    experts: Share | None = None,
) -> LoadedModel:
    """`kernels`: auto, c, torch or triton (services/model/layers/attention.py resolve_kernels);
    `deterministic`: row-invariant products on a GPU (services/model/layers/linear.py);
    `tensor`: (rank, ranks): one rank's slice of the model (parallel/tensor.py shard), its
    exchanges not yet in place (parallelize); `experts`: this process's share of a MoE
    model's routed experts (spread over processes: parallel/exchange.py), the only ones read
    and built (None: all)."""
    if quantization not in quantize.QUANTIZATIONS:  # refused before anything loads
        raise ValueError(
            f"unknown quantization {quantization!r} (choose {', '.join(quantize.QUANTIZATIONS)})"
        )
    dev = resolve_device(device)
    resolve_kernels(kernels, dev)  # refused before anything loads
    path = sources.resolve(spec)
    if quantization == "int8" and dev.type != "cpu":
        raise ModelLoadError(path, f"--quantization int8 runs on CPUs, not {dev}")
    config = hf_config.read_config(path)
    family = families.of(config).model_class()
    if quantization == "int8" and not family.supports(config).int8:
        raise ModelLoadError(
            path, "--quantization int8 covers dense Llama-family and Gemma 3 models only"
        )
    tokenizer = Tokenizer.from_dir(path)
    whole, rows = config, None
    if tensor[1] > 1:  # a rank reads its slices only
        if quantization != "none" or config.fp8_block is not None:
            raise ModelLoadError(path, "--tensor-parallel covers unquantized models")
        try:
            rows = slices(config, *tensor)
        except ValueError as e:
            raise ModelLoadError(path, str(e)) from None
    held = experts.experts(config.moe.num_experts) if experts and config.moe else None
    weights = hf_dir.read_weights(path, config, rows, held)
    if tensor[1] > 1:
        config, _ = sliced(config, weights, *tensor)
    model: CausalLM = family(
        config,
        weights,
        resolve_dtype(dtype, dev),
        dev,
        kernels=kernels,
        deterministic=deterministic,
    )
    encoder = None
    if config.vision is not None:
        encoder = build_encoder(
            config.vision, weights, config.hidden_size, resolve_dtype(dtype, dev), dev
        )
    if quantization == "int8":
        calibration = tokenizer.encode(quantize.calibration_text(), add_special_tokens=False)
        quantize.quantize_int8(model, weights, calibration)
    weights.release()  # what the model keeps, it holds; an expert rebuilt later reads its file
    return LoadedModel(model, tokenizer, path, whole if tensor[1] > 1 else None, encoder)


def load_encoder(
    spec: str, dtype: str = DEFAULTS.model.dtype, device: str = DEFAULTS.model.device
) -> tuple[ImageEncoder, ModelConfig, Path]:
    """A model's image encoder alone (an encode worker's): only its tensors are read."""
    dev = resolve_device(device)
    path = sources.resolve(spec)
    config = hf_config.read_config(path)
    if config.vision is None:
        raise ModelLoadError(path, "the model reads no images: nothing to encode")
    weights = hf_dir.read_weights(path, config, only=config.vision.weights)
    vision, width = config.vision, config.hidden_size
    encoder = build_encoder(vision, weights, width, resolve_dtype(dtype, dev), dev)
    return encoder, config, path


def load_mtp(
    path: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    kernels: str,
    deterministic: bool = DEFAULTS.model.deterministic,
) -> MtpLayer:
    """The checkpoint's first multi-token-prediction layer, its products as the model's
    (`kernels`, `deterministic`); ModelLoadError where it has none."""
    hf_dir.check_mtp(path, config)
    module = families.of(config).mtp_module()
    mtp: MtpLayer = module.load_mtp(path, config, dtype, device, kernels, deterministic)
    return mtp
