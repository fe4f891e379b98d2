"""Model architectures we can build, and the parsed shape of a Hugging Face `config.json`.

`ModelArchConfig` is the one description every model class, loader and the worker's KV sizing
read; it is built from a config.json dict (`from_hf_config`) or from GGUF metadata (loader).
Architectures map to "module:Class" and are imported on demand (the model files import this one).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
from dataclasses import dataclass
from typing import Any

import torch

MODEL_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "conveyor.model.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "conveyor.model.qwen3:Qwen3ForCausalLM",
}
"""HF `architectures[0]` -> "module:Class" (a constant)."""



class RopeType(enum.Enum):
    """Rope frequency schemes we implement (HF `rope_type` names)."""

    DEFAULT = "default"
    LINEAR = "linear"
    LLAMA3 = "llama3"


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RopeScaling:
    """Rope frequency scaling as HF's `rope_scaling` / `rope_parameters` describe it."""

    rope_type: RopeType = RopeType.DEFAULT
    """The scheme (DEFAULT means no scaling)."""
    factor: float = 1.0
    """Context extension factor (linear, llama3)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max / low_freq_factor are divided by `factor`."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max / high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192
    """llama3: the context length the model was pretrained with."""

    @classmethod
    def parse(cls, rope_type: str, **params: float) -> RopeScaling:
        """From HF's string name; an unsupported scheme raises with the supported ones."""
        names = [t.value for t in RopeType]
        if rope_type not in names:
            raise ValueError(f"rope_scaling.rope_type {rope_type!r} is not supported; use one of {names}")
        return cls(RopeType(rope_type), **params)


@dataclass(frozen=True)
class ModelArchConfig:
    """The model shape and numerics, from a HF config.json (or GGUF metadata)."""

    architecture: str
    """HF architecture name, a key of MODEL_ARCHITECTURES."""
    hidden_size: int
    """Residual stream width."""
    num_hidden_layers: int
    """Decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """KV heads (GQA when fewer than query heads)."""
    head_dim: int
    """Per-head width (config `head_dim`, else hidden_size // num_attention_heads)."""
    intermediate_size: int
    """MLP inner width."""
    vocab_size: int
    """Embedding rows / logits width."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Rope base frequency."""
    rope_scaling: RopeScaling = RopeScaling()
    """Rope frequency scaling."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix."""
    attention_bias: bool = False
    """q/k/v projections carry a bias."""
    max_position_embeddings: int = 2048
    """Longest position the model was trained for."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id, if any."""
    eos_token_ids: tuple[int, ...] = ()
    """End-of-sequence token ids (config may list several; the loader prefers generation_config.json's)."""
    torch_dtype: str = "float32"
    """The checkpoint's dtype name (float32, bfloat16, float16)."""

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES.get(self.torch_dtype, torch.float32)

    def with_num_layers(self, num_hidden_layers: int) -> ModelArchConfig:
        """The same model truncated to its first num_hidden_layers layers."""
        return dataclasses.replace(self, num_hidden_layers=min(num_hidden_layers, self.num_hidden_layers))

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArchConfig:
        """Parse a config.json dict; unknown architectures raise with the supported list."""
        architecture = _architecture_of(config)
        heads = int(config["num_attention_heads"])
        rope_theta, scaling = _rope_of(config)
        return cls(
            architecture=architecture,
            hidden_size=int(config["hidden_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_token_ids_of(config.get("eos_token_id")),
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        )


def eos_token_ids_of(value: Any) -> tuple[int, ...]:
    """An `eos_token_id` of config.json or generation_config.json: an int, a list of ints, or absent."""
    if value is None:
        return ()
    return tuple(int(i) for i in value) if isinstance(value, list) else (int(value),)


def _architecture_of(config: dict[str, Any]) -> str:
    architectures = config.get("architectures") or []
    if not architectures:
        raise ValueError("config.json has no 'architectures' list; cannot tell which model to build")
    name = architectures[0]
    if name not in MODEL_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name!r}; supported: {sorted(MODEL_ARCHITECTURES)}")
    return name


def _rope_of(config: dict[str, Any]) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling) from either the classic keys or transformers 5's `rope_parameters`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    fields = {f.name for f in dataclasses.fields(RopeScaling)} - {"rope_type"}
    kwargs = {k: v for k, v in params.items() if k in fields and v is not None}
    return theta, RopeScaling.parse(rope_type, **kwargs)


def get_model_class(architecture: str) -> type:
    """The nn.Module class implementing `architecture`."""
    if architecture not in MODEL_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(MODEL_ARCHITECTURES)}")
    module_name, class_name = MODEL_ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(module_name), class_name)
