"""GGUF blocks served as they are: reading them, the quantized Linear / Embedding, and the model swap."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conveyor.kernels.cpu_build import cpu_kernels_available
from conveyor.kernels.gguf_matmul import q4_dequantize_ref, q8_0_dequantize_ref
from conveyor.model.gguf_weights import native_block_format, read_gguf
from conveyor.model.quantized import (
    MAX_KERNEL_ROWS,
    BlockFormat,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    quantize_modules,
)

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="no C compiler for the CPU kernels")


def write_gguf(path: pathlib.Path, qtype_name: str, data: np.ndarray) -> pathlib.Path:
    """A one-tensor GGUF holding `data` quantized as `qtype_name`."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[qtype_name]
    writer = GGUFWriter(str(path), arch="llama")
    writer.add_tensor("blk.0.ffn_up.weight", quantize(data, qtype), raw_dtype=qtype)  # shape from the bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference_dequantize(weight: QuantizedWeight) -> torch.Tensor:
    if weight.block_format == BlockFormat.Q4:
        assert weight.mins is not None
        return q4_dequantize_ref(weight.qweight, weight.scales, weight.mins)
    return q8_0_dequantize_ref(weight.qweight, weight.scales)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_read_as_they_are_dequantize_to_what_the_float_path_reads(qtype: str, tmp_path) -> None:
    data = np.random.default_rng(0).normal(size=(12, 96)).astype(np.float32)
    gguf = read_gguf(write_gguf(tmp_path / "w.gguf", qtype, data))
    (info,) = gguf.tensors
    blocks = gguf.read_blocks(info)
    assert native_block_format(info) == blocks.block_format and blocks.shape == (12, 96)
    assert torch.equal(reference_dequantize(blocks), gguf.read(info))  # the same weights, exactly


def test_unsupported_types_are_dequantized_instead(tmp_path) -> None:
    data = np.random.default_rng(1).normal(size=(4, 32)).astype(np.float32)
    gguf = read_gguf(write_gguf(tmp_path / "w.gguf", "Q5_0", data))
    assert native_block_format(gguf.tensors[0]) is None
    with pytest.raises(ValueError, match="no block kernel"):
        gguf.read_blocks(gguf.tensors[0])


def random_q4(n: int, k: int, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    return QuantizedWeight(BlockFormat.Q4, torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
                           torch.rand(n, k // 32, generator=gen) * 0.05, -torch.rand(n, k // 32, generator=gen) * 0.4)


@pytest.mark.parametrize("num_rows", [1, 5, MAX_KERNEL_ROWS, MAX_KERNEL_ROWS + 1, 40])
def test_quantized_linear_is_the_float_linear_of_its_dequantized_weight(num_rows: int) -> None:
    weight = random_q4(24, 64)
    layer = QuantizedLinear(64, 24, BlockFormat.Q4, bias=True)
    layer.load_rows(0, weight)
    with torch.no_grad():
        layer.bias.copy_(torch.arange(24.0))
    x = torch.randn(num_rows, 64)
    torch.testing.assert_close(layer(x), F.linear(x, reference_dequantize(weight), layer.bias), atol=1e-4, rtol=1e-5)


def test_fused_shards_land_in_their_rows() -> None:
    q, k = random_q4(8, 64, seed=1), random_q4(4, 64, seed=2)
    layer = QuantizedLinear(64, 12, BlockFormat.Q4, bias=False)
    layer.load_rows(0, q)
    layer.load_rows(8, k)
    expected = torch.cat((reference_dequantize(q), reference_dequantize(k)))
    assert torch.equal(reference_dequantize(layer.weight_parts()), expected)
    with pytest.raises(ValueError, match="does not fit"):
        layer.load_rows(0, random_q4(4, 32))


def test_row_permutation_commutes_with_dequantization() -> None:
    weight = random_q4(6, 64, seed=3)
    order = torch.tensor([5, 0, 3, 1, 4, 2])
    assert torch.equal(reference_dequantize(weight.map_rows(lambda rows: rows[order])),
                       reference_dequantize(weight)[order])


def test_quantized_embedding_looks_up_and_projects() -> None:
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(-128, 128, (50, 64), dtype=torch.int8, generator=gen)
    table = QuantizedWeight(BlockFormat.Q8_0, codes, torch.rand(50, 2, generator=gen), None)
    embedding = QuantizedEmbedding(50, 64, BlockFormat.Q8_0)
    embedding.load_rows(0, table)
    dense = reference_dequantize(table)
    ids = torch.tensor([3, 3, 49, 0])
    assert torch.equal(embedding(ids), dense[ids])
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(embedding.project(hidden), hidden @ dense.T, atol=1e-4, rtol=1e-5)


def test_quantize_modules_swaps_without_allocating() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(10, 32), torch.nn.Linear(32, 8), torch.nn.Linear(8, 8))
    quantize_modules(model, {"0": BlockFormat.Q8_0, "1": BlockFormat.Q4})
    assert isinstance(model[0], QuantizedEmbedding) and isinstance(model[1], QuantizedLinear)
    assert type(model[2]) is torch.nn.Linear
    assert all(t.is_meta for t in model.buffers())
    with pytest.raises(ValueError, match="only Linear and Embedding"):
        quantize_modules(torch.nn.Sequential(torch.nn.ReLU()), {"0": BlockFormat.Q4})
