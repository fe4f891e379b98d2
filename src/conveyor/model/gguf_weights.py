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
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
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
# GGUF metadata value types: struct codes of the scalars, and the two compound types.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file."""

    name: str
    """llama.cpp tensor name."""
    shape: tuple[int, ...]
    """Logical shape in PyTorch order (GGUF lists dims innermost first; this is reversed)."""
    qtype: GGMLQuantizationType
    """Storage type (F32, F16, Q4_1, Q8_0, ...)."""
    offset_bytes: int
    """Absolute byte offset of the data in the file."""


@dataclass
class GGUFFile:
    """A parsed GGUF header (metadata + tensor table); tensor data is read on demand.

    Our own struct parser: gguf.GGUFReader wraps each of the ~100k vocabulary strings in numpy
    views and takes seconds; this reads the header in a fraction of that.
    """

    path: pathlib.Path
    """The file."""
    metadata: dict[str, Any]
    """Key/value metadata (strings, numbers, lists)."""
    tensors: list[GGUFTensorInfo]
    """Tensor table in file order."""

    def read(self, info: GGUFTensorInfo) -> torch.Tensor:
        """The tensor dequantized to float32, shaped info.shape."""
        block_size, type_size = GGML_QUANT_SIZES[info.qtype]
        num_bytes = int(np.prod(info.shape)) * type_size // block_size
        raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset_bytes, shape=(num_bytes,))
        if info.qtype in _FAST_DEQUANTIZERS:
            blocks = torch.from_numpy(np.array(raw)).view(-1, type_size)  # [num_blocks, type_size]
            return _FAST_DEQUANTIZERS[info.qtype](blocks).reshape(info.shape)
        rows = raw.reshape(-1, info.shape[-1] * type_size // block_size)  # [rows, bytes per row]
        array = np.asarray(dequantize(rows, info.qtype), dtype=np.float32).reshape(info.shape)
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
    path = pathlib.Path(path)
    with open(path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ValueError(f"{str(path)!r} is not a GGUF file")
        version, num_tensors, num_kv = struct.unpack("<IQQ", handle.read(20))
        if version < 2:
            raise ValueError(f"{str(path)!r}: GGUF version {version} is too old (need >= 2)")
        metadata = {}
        for _ in range(num_kv):
            key = _read_string(handle)
            metadata[key] = _read_value(handle, struct.unpack("<I", handle.read(4))[0])
        table = [_read_tensor_info(handle) for _ in range(num_tensors)]
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-handle.tell() // alignment) * alignment
    tensors = [GGUFTensorInfo(name, shape, qtype, data_start + offset) for name, shape, qtype, offset in table]
    return GGUFFile(path=path, metadata=metadata, tensors=tensors)


def _read_tensor_info(handle: BinaryIO) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = _read_string(handle)
    (num_dims,) = struct.unpack("<I", handle.read(4))
    dims = struct.unpack(f"<{num_dims}Q", handle.read(8 * num_dims))
    qtype, offset = struct.unpack("<IQ", handle.read(12))
    return name, tuple(reversed(dims)), GGMLQuantizationType(qtype), offset


def _read_string(handle: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", handle.read(8))
    return handle.read(length).decode("utf-8", errors="replace")


def _read_value(handle: BinaryIO, value_type: int) -> Any:
    if value_type == _STRING:
        return _read_string(handle)
    if value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", handle.read(12))
        if item_type in _SCALARS:  # one bulk unpack instead of `count` small ones
            code = _SCALARS[item_type]
            return list(struct.unpack(f"<{count}{code}", handle.read(struct.calcsize(code) * count)))
        return [_read_value(handle, item_type) for _ in range(count)]
    if value_type not in _SCALARS:
        raise ValueError(f"unknown GGUF metadata value type {value_type}")
    code = _SCALARS[value_type]
    return struct.unpack(f"<{code}", handle.read(struct.calcsize(code)))[0]


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
