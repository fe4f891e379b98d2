"""ModelArchConfig parsing of HF config.json dicts (classic and transformers-5 rope keys)."""

from __future__ import annotations

import json
import pathlib

import pytest

from conveyor.model.registry import ModelArchConfig, RopeScaling, RopeType, get_model_class

BENCH_MODELS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "models"


def load(name: str) -> dict:
    return json.loads((BENCH_MODELS / name / "config.json").read_text())


def test_llama31_config() -> None:
    config = ModelArchConfig.from_hf_config(load("llama-3.1-8b"))
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (32, 32, 8)
    assert config.head_dim == 128 and config.rope_theta == 500000.0 and not config.tie_word_embeddings
    assert config.rope_scaling == RopeScaling(RopeType.LLAMA3, 8.0, 1.0, 4.0, 8192)
    assert config.eos_token_ids == (128001,) and config.torch_dtype == "bfloat16"
    assert get_model_class(config.architecture).__name__ == "LlamaForCausalLM"


def test_qwen3_config() -> None:
    config = ModelArchConfig.from_hf_config(load("qwen3-0.6b"))
    assert config.head_dim == 128 and config.hidden_size == 1024  # head_dim != hidden / heads
    assert config.tie_word_embeddings and config.rope_scaling.rope_type == RopeType.DEFAULT
    assert get_model_class(config.architecture).__name__ == "Qwen3ForCausalLM"


def test_transformers5_rope_parameters_and_eos_list() -> None:
    raw = load("llama-3.1-8b")
    scaling = raw.pop("rope_scaling")
    raw["rope_parameters"] = {**scaling, "rope_theta": raw.pop("rope_theta")}
    raw["eos_token_id"] = [128001, 128008, 128009]
    config = ModelArchConfig.from_hf_config(raw)
    assert config.rope_theta == 500000.0 and config.rope_scaling.factor == 8.0
    assert config.eos_token_ids == (128001, 128008, 128009)


def test_with_num_layers_truncates_only() -> None:
    config = ModelArchConfig.from_hf_config(load("qwen3-0.6b"))
    assert config.with_num_layers(2).num_hidden_layers == 2
    assert config.with_num_layers(99).num_hidden_layers == 28


def test_missing_architectures_is_a_clear_error() -> None:
    raw = load("qwen3-0.6b")
    del raw["architectures"]
    with pytest.raises(ValueError, match="no 'architectures'"):
        ModelArchConfig.from_hf_config(raw)
