"""Reading a llama.cpp GGUF file as a Hugging Face-shaped model: arch config and HF-named tensors.

A GGUF stores the config as `<arch>.*` metadata keys and the weights under llama.cpp names
(`blk.3.attn_q.weight`), usually block-quantized (Q4_1, Q8_0, ...). We dequantize every tensor to
float32 with `gguf.quants.dequantize` on load (we serve unquantized weights) and rename it to the
HF name. One trap: for the `llama` architecture llama.cpp's converter permutes the rows of the Q
and K projections so that rope can rotate adjacent pairs (GPT-J style); our rope is HF's
rotate_half, which pairs dimension i with i + d/2, so those rows are permuted back here.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from conveyor.model.registry import ModelArchConfig, RopeScaling

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
"""GGUF `general.architecture` -> HF architecture name."""

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def read_gguf(path: str | pathlib.Path) -> GGUFReader:
    """Open a GGUF (memory-mapped; tensors are read lazily)."""
    return GGUFReader(str(path))


def field_value(reader: GGUFReader, key: str) -> Any:
    """A metadata value as Python (str, int, float, bool or list), or None if absent."""
    field = reader.get_field(key)
    if field is None:
        return None
    if field.types[0] == GGUFValueType.ARRAY and field.types[-1] == GGUFValueType.STRING:
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    return field.contents()


def arch_config_from_gguf(reader: GGUFReader) -> ModelArchConfig:
    """The ModelArchConfig a GGUF's `<arch>.*` metadata describes."""
    gguf_arch = field_value(reader, "general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {gguf_arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("this GGUF carries rope_freqs (llama3 rope scaling); load the safetensors checkpoint instead")

    def meta(key: str, default: Any = None) -> Any:
        value = field_value(reader, f"{gguf_arch}.{key}")
        return default if value is None else value

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    return ModelArchConfig(
        architecture=GGUF_ARCHITECTURES[gguf_arch],
        hidden_size=hidden,
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("attention.key_length", hidden // heads)),
        intermediate_size=int(meta("feed_forward_length")),
        vocab_size=int(meta("vocab_size", len(field_value(reader, "tokenizer.ggml.tokens") or []))),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=RopeScaling(),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        max_position_embeddings=int(meta("context_length", 2048)),
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        torch_dtype="float32",
    )


def hf_name_of(gguf_name: str) -> str:
    """llama.cpp tensor name -> HF name; unknown names raise."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    match = _LAYER_TENSOR.match(gguf_name)
    if not match or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, rows (pair j, member m) -> (m, j).

    The converter wrote rows as reshape(heads, 2, d/2).swapaxes(1, 2); this applies the inverse.
    weight [num_heads * d, ...] -> same shape.
    """
    rows = weight.shape[0]
    rest = weight.shape[1:]
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def iter_gguf_weights(reader: GGUFReader, config: ModelArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of the first config.num_hidden_layers layers."""
    permute = config.architecture == "LlamaForCausalLM"
    for tensor in reader.tensors:
        match = _LAYER_TENSOR.match(tensor.name)
        if match and int(match.group(1)) >= config.num_hidden_layers:
            continue  # truncated model: skip the (costly) dequantization
        shape = [int(n) for n in reversed(tensor.shape.tolist())]  # GGUF lists dims innermost first
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        weight = torch.from_numpy(array.copy())
        name = hf_name_of(tensor.name)
        if permute and ".q_proj." in name:
            weight = unpermute_rope_rows(weight, config.num_attention_heads)
        elif permute and ".k_proj." in name:
            weight = unpermute_rope_rows(weight, config.num_key_value_heads)
        yield name, weight
