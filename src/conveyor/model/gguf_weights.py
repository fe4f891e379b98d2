"""Reading a llama.cpp GGUF file as a Hugging Face-shaped model: arch config and HF-named tensors.

A GGUF stores the config as `<arch>.*` metadata keys and the weights under llama.cpp names
(`blk.3.attn_q.weight`), usually block-quantized (Q4_1, Q8_0, ...). Each tensor is renamed to its
HF name and either dequantized to float32 on load (`read`; any GGUF type) or, for the types the CPU
kernels compute on (Q4_0, Q4_1, Q8_0), kept in its blocks (`read_blocks`, see model/quantized.py). One trap: for the `llama` architecture llama.cpp's converter permutes the rows of the Q
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
from conveyor.model.quantized import BlockFormat, QuantizedWeight
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

    def read_blocks(self, info: GGUFTensorInfo) -> QuantizedWeight:
        """A 2-D Q4_0 / Q4_1 / Q8_0 tensor [N, K] kept in its blocks (see `native_block_format`)."""
        qtype = GGMLQuantizationType(info.ggml_type)
        if native_block_format(info) is None:
            raise ValueError(f"{info.name}: {qtype.name} {info.shape} has no block kernel; read it dequantized")
        _, type_size = GGML_QUANT_SIZES[qtype]
        rows, cols = info.shape
        num_bytes = rows * cols // 32 * type_size
        raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset_bytes, shape=(num_bytes,))
        blocks = torch.from_numpy(np.array(raw)).view(rows, cols // 32, type_size)  # [N, K/32, bytes]
        return _BLOCK_READERS[qtype](blocks)


def native_block_format(info: GGUFTensorInfo) -> BlockFormat | None:
    """The kernel layout a tensor can be served in as it is, or None (it is dequantized on load)."""
    qtype = GGMLQuantizationType(info.ggml_type)
    if len(info.shape) != 2 or info.shape[-1] % 32 or qtype not in _BLOCK_READERS:
        return None
    return BlockFormat.Q8_0 if qtype == GGMLQuantizationType.Q8_0 else BlockFormat.Q4


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """[N, K/32, bytes] uint8 -> [N, K/32] float32 from the float16 at byte `start` of each block."""
    return blocks[:, :, start : start + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _q4_1_blocks(blocks: torch.Tensor) -> QuantizedWeight:
    """Q4_1 blocks (f16 d, f16 m, 16 bytes of nibbles) as they are."""
    codes = blocks[:, :, 4:].reshape(blocks.shape[0], -1).contiguous()  # [N, K/2]
    return QuantizedWeight(BlockFormat.Q4, codes, _f16(blocks, 0), _f16(blocks, 2))


def _q4_0_blocks(blocks: torch.Tensor) -> QuantizedWeight:
    """Q4_0 blocks (f16 d, 16 bytes of nibbles; w = d (q - 8)) as Q4 with m = -8 d (exact in float32)."""
    scales = _f16(blocks, 0)
    codes = blocks[:, :, 2:].reshape(blocks.shape[0], -1).contiguous()
    return QuantizedWeight(BlockFormat.Q4, codes, scales, -8.0 * scales)


def _q8_0_blocks(blocks: torch.Tensor) -> QuantizedWeight:
    """Q8_0 blocks (f16 d, 32 int8) as they are."""
    codes = blocks[:, :, 2:].reshape(blocks.shape[0], -1).contiguous().view(torch.int8)  # [N, K]
    return QuantizedWeight(BlockFormat.Q8_0, codes, _f16(blocks, 0), None)


_BLOCK_READERS = {
    GGMLQuantizationType.Q4_0: _q4_0_blocks,
    GGMLQuantizationType.Q4_1: _q4_1_blocks,
    GGMLQuantizationType.Q8_0: _q8_0_blocks,
}


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


def iter_gguf_weights(
    gguf: GGUFFile, config: ModelArchConfig, keep_blocks: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(HF name, tensor) for every tensor of the first config.num_hidden_layers layers: a
    QuantizedWeight for the HF names in `keep_blocks`, a float32 tensor for every other."""
    permute = config.architecture == "LlamaForCausalLM"
    for info in gguf.tensors:
        match = _LAYER_TENSOR.match(info.name)
        if match and int(match.group(1)) >= config.num_hidden_layers:
            continue  # truncated model: skip the (costly) dequantization
        name = hf_name_of(info.name)
        weight = gguf.read_blocks(info) if name in keep_blocks else gguf.read(info)
        heads = None
        if permute and ".q_proj." in name:
            heads = config.num_attention_heads
        elif permute and ".k_proj." in name:
            heads = config.num_key_value_heads
        if heads is not None and isinstance(weight, QuantizedWeight):
            weight = weight.map_rows(lambda rows: unpermute_rope_rows(rows, heads))
        elif heads is not None:
            weight = unpermute_rope_rows(weight, heads)
        yield name, weight


def block_formats_by_hf_name(gguf: GGUFFile) -> dict[str, BlockFormat | None]:
    """HF name -> the block layout each 2-D tensor could be served in (None: dequantized)."""
    return {hf_name_of(info.name): native_block_format(info) for info in gguf.tensors if len(info.shape) == 2}
