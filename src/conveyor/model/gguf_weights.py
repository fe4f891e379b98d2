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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from conveyor.gguf_header import GGUFTensorEntry, read_gguf_header
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


GGUFTensorInfo = GGUFTensorEntry
"""One tensor table row (the shared header reader's type)."""


@dataclass
class GGUFFile:
    """A parsed GGUF header (metadata + tensor table, see conveyor.gguf_header); data is read on demand."""

    path: pathlib.Path
    """The file."""
    metadata: dict[str, Any]
    """Key/value metadata (strings, numbers, lists)."""
    tensors: list[GGUFTensorInfo]
    """Tensor table in file order."""

    def read(self, info: GGUFTensorInfo) -> torch.Tensor:
        """The tensor dequantized to float32, shaped info.shape."""
        qtype = GGMLQuantizationType(info.ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        num_bytes = int(np.prod(info.shape)) * type_size // block_size
        raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset_bytes, shape=(num_bytes,))
        if qtype in _FAST_DEQUANTIZERS:
            blocks = torch.from_numpy(np.array(raw)).view(-1, type_size)  # [num_blocks, type_size]
            return _FAST_DEQUANTIZERS[qtype](blocks).reshape(info.shape)
        rows = raw.reshape(-1, info.shape[-1] * type_size // block_size)  # [rows, bytes per row]
        array = np.asarray(dequantize(rows, qtype), dtype=np.float32).reshape(info.shape)
        return torch.from_numpy(array.copy())


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks [n, 34] uint8 (f16 scale d, 32 int8 q) -> [n * 32] float32 = d * q."""
    scale = blocks[:, :2].contiguous().view(torch.float16).float()  # [n, 1]
    quants = blocks[:, 2:].contiguous().view(torch.int8).float()  # [n, 32]
    return (scale * quants).reshape(-1)


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks [n, 20] uint8 (f16 d, f16 m, 16 bytes of nibbles) -> [n * 32] float32 = d * q + m.

    Byte j holds element j in its low nibble and element j + 16 in its high nibble.
    """
    scale = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [n, 1]
    offset = blocks[:, 2:4].contiguous().view(torch.float16).float()  # [n, 1]
    packed = blocks[:, 4:]  # [n, 16]
    quants = torch.cat((packed & 0x0F, packed >> 4), dim=1).float()  # [n, 32]
    return (scale * quants + offset).reshape(-1)


# Vectorized torch versions of the two types the embedded model uses (gguf's numpy path is ~20x slower);
# tests check them against gguf.quants.dequantize, which handles every other type.
_FAST_DEQUANTIZERS = {GGMLQuantizationType.Q8_0: dequantize_q8_0, GGMLQuantizationType.Q4_1: dequantize_q4_1}


def read_gguf(path: str | pathlib.Path) -> GGUFFile:
    """Parse a GGUF header: metadata and tensor table (data stays on disk until `read`)."""
    header = read_gguf_header(path)
    return GGUFFile(path=header.path, metadata=header.metadata, tensors=header.tensors)


def arch_config_from_gguf(gguf: GGUFFile) -> ModelArchConfig:
    """The ModelArchConfig a GGUF's `<arch>.*` metadata describes."""
    metadata = gguf.metadata
    gguf_arch = metadata.get("general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {gguf_arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}")
    tensor_names = {t.name for t in gguf.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("this GGUF carries rope_freqs (llama3 rope scaling); load the safetensors checkpoint instead")

    def meta(key: str, default: Any = None) -> Any:
        return metadata.get(f"{gguf_arch}.{key}", default)

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    return ModelArchConfig(
        architecture=GGUF_ARCHITECTURES[gguf_arch],
        hidden_size=hidden,
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("attention.key_length", hidden // heads)),
        intermediate_size=int(meta("feed_forward_length")),
        vocab_size=int(meta("vocab_size", len(metadata.get("tokenizer.ggml.tokens", [])))),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=RopeScaling(),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        max_position_embeddings=int(meta("context_length", 2048)),
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
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


def iter_gguf_weights(gguf: GGUFFile, config: ModelArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of the first config.num_hidden_layers layers."""
    permute = config.architecture == "LlamaForCausalLM"
    for info in gguf.tensors:
        match = _LAYER_TENSOR.match(info.name)
        if match and int(match.group(1)) >= config.num_hidden_layers:
            continue  # truncated model: skip the (costly) dequantization
        weight = gguf.read(info)
        name = hf_name_of(info.name)
        if permute and ".q_proj." in name:
            weight = unpermute_rope_rows(weight, config.num_attention_heads)
        elif permute and ".k_proj." in name:
            weight = unpermute_rope_rows(weight, config.num_key_value_heads)
        yield name, weight
