"""The C CPU kernels (kernels/cpu/) equal their torch references; the build reports why it cannot run."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels import cpu_build
from conveyor.kernels.elementwise_cpu import (
    rms_norm_cpu,
    rms_norm_ref,
    rotary_cpu_,
    rotary_ref,
    silu_and_mul_cpu,
    silu_and_mul_ref,
)
from conveyor.kernels.gguf_matmul import (
    q4_dequantize,
    q4_dequantize_ref,
    q4_matmul,
    q4_matmul_ref,
    q8_0_dequantize,
    q8_0_dequantize_ref,
    q8_0_matmul,
    q8_0_matmul_ref,
)
from conveyor.kernels.paged_attention_cpu import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)

pytestmark = pytest.mark.skipif(not cpu_build.cpu_kernels_available(), reason="no C compiler for the CPU kernels")


def q4_weight(num_rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (num_rows, k // 2), dtype=torch.uint8, generator=gen)
    return codes, torch.rand(num_rows, k // 32, generator=gen) * 0.1, -torch.rand(num_rows, k // 32, generator=gen)


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 8, 13, 16])  # tiles of 1-8 rows; 4+ with 2 columns sum by transpose
@pytest.mark.parametrize(("n", "k"), [(40, 64), (7, 96), (96, 576)])  # odd n: one-column tiles
def test_q4_matmul_matches_the_dequantized_float32_matmul(num_rows: int, n: int, k: int) -> None:
    qweight, scales, mins = q4_weight(n, k, seed=num_rows + n)
    x = torch.randn(num_rows, k, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(q4_matmul(x, qweight, scales, mins), q4_matmul_ref(x, qweight, scales, mins),
                               atol=1e-4, rtol=1e-5)


# K/32 over 16: a vector of m terms; n = 1, 7, 16, 40: a partial, a whole and 2.5 groups of 16 rows; odd K/32: the
# even/odd accumulators' last block
@pytest.mark.parametrize(("n", "k"), [(40, 64), (7, 96), (1, 32), (16, 160), (960, 576), (576, 1536)])
def test_q4_one_row_is_within_float32_accumulation_error_of_the_tile_path(n: int, k: int) -> None:
    # One input row takes the factored kernel, d (q . x) + m sum(x) per block; the same row in a 2-row
    # input takes the tiles' w = d q + m (the path before). Both against a float64 reference, bounded
    # by float32 accumulation error: a few ulps of sum |x| |w| per output.
    qweight, scales, mins = q4_weight(n, k, seed=n + k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(2))
    weight = q4_dequantize_ref(qweight, scales, mins).double()
    exact = x.double() @ weight.T
    bound = 8 * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.abs().T)
    one_row = q4_matmul(x, qweight, scales, mins)
    tile = q4_matmul(x.repeat(2, 1), qweight, scales, mins)[:1]
    assert torch.all((one_row.double() - exact).abs() <= bound)
    assert torch.all((tile.double() - exact).abs() <= bound)


@pytest.mark.parametrize(("n", "k"), [(21, 128), (300, 576), (64, 1024), (1, 32), (17, 96)])  # K/32 = 32: two vectors
def test_q8_0_one_row_is_within_float32_accumulation_error_of_the_tile_path(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n)
    qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, k // 32, generator=gen) * 0.01
    x = torch.randn(1, k, generator=gen)
    weight = q8_0_dequantize_ref(qweight, scales).double()
    exact = x.double() @ weight.T
    bound = 8 * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.abs().T)
    assert torch.all((q8_0_matmul(x, qweight, scales).double() - exact).abs() <= bound)
    assert torch.all((q8_0_matmul(x.repeat(2, 1), qweight, scales)[:1].double() - exact).abs() <= bound)


@pytest.mark.parametrize("num_rows", [1, 3, 4, 6, 8, 13])  # 4+: the accumulators' transpose-and-sum
def test_q8_0_matmul_matches_the_dequantized_float32_matmul(num_rows: int) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    qweight = torch.randint(-128, 128, (21, 128), dtype=torch.int8, generator=gen)
    scales = torch.rand(21, 4, generator=gen) * 0.01
    x = torch.randn(num_rows, 128, generator=gen)
    torch.testing.assert_close(q8_0_matmul(x, qweight, scales), q8_0_matmul_ref(x, qweight, scales),
                               atol=1e-5, rtol=1e-5)


def test_dequantizers_match_their_references() -> None:
    qweight, scales, mins = q4_weight(9, 64, seed=3)
    # d q + m: the kernel's fused multiply-add rounds once, the reference twice
    torch.testing.assert_close(q4_dequantize(qweight, scales, mins), q4_dequantize_ref(qweight, scales, mins),
                               atol=1e-7, rtol=2e-7)
    codes = torch.randint(-128, 128, (9, 64), dtype=torch.int8)
    assert torch.equal(q8_0_dequantize(codes, scales), q8_0_dequantize_ref(codes, scales))


def test_q4_wrapper_checks_shapes() -> None:
    qweight, scales, mins = q4_weight(8, 64, seed=0)
    with pytest.raises(AssertionError):
        q4_matmul(torch.randn(2, 32), qweight, scales, mins)  # K mismatch
    with pytest.raises(AssertionError):
        q4_matmul(torch.randn(2, 64, dtype=torch.float64), qweight, scales, mins)


@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "head_dim"),
                         [(16, 9, 3, 64), (4, 8, 2, 32), (32, 4, 4, 128), (256, 6, 1, 16), (16, 12, 12, 16)])
@pytest.mark.parametrize("num_threads", [1, 4])  # 6 queries: one item each; with 4 threads, one per KV head
def test_paged_decode_attention_matches_the_reference(block_size, num_heads, num_kv_heads, head_dim, num_threads,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # queries of 1 token (decodes) and of several (a verify step's 1 + K, the 8-token maximum), in
    # another order than the sequences, their rows not adjacent
    monkeypatch.setattr(torch, "get_num_threads", lambda: num_threads)
    gen = torch.Generator().manual_seed(block_size)
    seq_lens, query_lens = [1, 7, block_size, block_size + 1, 290, 40], [1, 4, 1, 2, 8, 1]
    blocks_each = -(-max(seq_lens) // block_size)
    num_blocks = blocks_each * len(seq_lens) + 2
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: blocks_each * len(seq_lens)].view(len(seq_lens), -1)
    order, starts, row = [4, 0, 2, 1, 5, 3], {}, 1
    for i in order:
        starts[i], row = row, row + query_lens[i] + 1  # a row of no query between queries
    query = torch.randn(row, num_heads, head_dim, generator=gen)
    args = (query, kv_cache, torch.tensor([starts[i] for i in order]), torch.tensor([query_lens[i] for i in order]),
            torch.tensor(order), tables.int().contiguous(), torch.tensor(seq_lens, dtype=torch.int32), head_dim**-0.5)
    out, expected = torch.zeros_like(query), torch.zeros_like(query)
    paged_decode_attention(*args, out)
    paged_decode_attention_ref(*args, expected)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    untouched = torch.ones(row, dtype=torch.bool)
    for i in order:
        untouched[starts[i]:starts[i] + query_lens[i]] = False
    assert out[untouched].abs().sum() == 0


@pytest.mark.parametrize(("block_size", "num_kv_heads"), [(16, 3), (4, 2), (32, 3)])
@pytest.mark.parametrize("num_threads", [1, 2])  # one thread: one item over every KV head; two: one per KV head
@pytest.mark.parametrize("query_len", [1, 4])
def test_paged_decode_attention_of_one_long_sequence(block_size, num_kv_heads, num_threads, query_len,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # a lone query over 1001 keys in blocks scattered out of order through a larger cache: the next
    # block's prefetch follows the table, the last block is partial
    monkeypatch.setattr(torch, "get_num_threads", lambda: num_threads)
    gen = torch.Generator().manual_seed(block_size + query_len)
    seq_len, num_heads, head_dim = 1001, 3 * num_kv_heads, 64
    num_blocks = 2 * -(-seq_len // block_size)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[None, : -(-seq_len // block_size)].int().contiguous()
    query = torch.randn(query_len, num_heads, head_dim, generator=gen)
    args = (query, kv_cache, torch.tensor([0]), torch.tensor([query_len]), torch.tensor([0]), table,
            torch.tensor([seq_len], dtype=torch.int32), head_dim**-0.5)
    out, expected = torch.zeros_like(query), torch.zeros_like(query)
    paged_decode_attention(*args, out)
    paged_decode_attention_ref(*args, expected)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_paged_decode_attention_rejects_a_query_over_8_tokens() -> None:
    kv_cache = torch.zeros(2, 2, 16, 1, 16)
    with pytest.raises(AssertionError, match="query's length"):
        paged_decode_attention(torch.zeros(9, 1, 16), kv_cache, torch.tensor([0]), torch.tensor([9]), torch.tensor([0]),
                               torch.zeros(1, 1, dtype=torch.int32), torch.tensor([9], dtype=torch.int32), 0.25,
                               torch.zeros(9, 1, 16))


def test_build_without_a_compiler_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_build.shutil, "which", lambda _name: None)
    with pytest.raises(cpu_build.CPUKernelsUnavailable, match="no C compiler"):
        cpu_build.cpu_kernels.__wrapped__()


def test_a_failed_build_reports_the_compiler_error(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken.c").write_text("int f(void) { return }\n")
    monkeypatch.setattr(cpu_build, "SOURCE_DIR", tmp_path)
    monkeypatch.setattr(cpu_build, "_cache_dir", lambda: tmp_path)
    with pytest.raises(cpu_build.CPUKernelsUnavailable, match="building the CPU kernels failed"):
        cpu_build.cpu_kernels.__wrapped__()


@pytest.mark.parametrize("num_rows", [1, 7, 80])
@pytest.mark.parametrize("cols", [576, 64, 40])
def test_rms_norm_matches_the_eager_formula_on_strided_rows(num_rows: int, cols: int) -> None:
    x = torch.randn(num_rows, 3, cols)[:, 1]  # rows 3 * cols apart
    weight = torch.randn(cols)
    torch.testing.assert_close(rms_norm_cpu(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("num_tokens", "head_dim"), [(1, 64), (9, 128), (70, 40)])
def test_rotary_in_place_matches_rotate_half(num_tokens: int, head_dim: int) -> None:
    qkv = torch.randn(num_tokens, 7 * head_dim)
    q = qkv[:, : 4 * head_dim].view(num_tokens, 4, head_dim)  # a view into the fused output
    cos, sin = torch.randn(num_tokens, head_dim), torch.randn(num_tokens, head_dim)
    expected = rotary_ref(q.clone(), cos, sin)
    untouched = qkv[:, 4 * head_dim :].clone()
    rotary_cpu_(q, cos, sin)
    torch.testing.assert_close(q, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, 4 * head_dim :], untouched)


@pytest.mark.parametrize(("num_rows", "inner"), [(1, 1536), (5, 24), (65, 100)])
def test_silu_and_mul_matches_torch(num_rows: int, inner: int) -> None:
    gate_up = torch.randn(num_rows, 2 * inner) * 6
    torch.testing.assert_close(silu_and_mul_cpu(gate_up), silu_and_mul_ref(gate_up), atol=1e-6, rtol=1e-5)


X86 = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 avx512f
processor\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 avx512f
"""


def test_the_build_is_keyed_by_the_cpu_not_the_hostname(monkeypatch: pytest.MonkeyPatch) -> None:
    """A library built with -march=native for one CPU must not be loaded on a CPU without its
    instructions; the same CPU under another hostname reuses it."""
    same = cpu_build.cpu_identity(X86.replace("avx512f", "avx512f ").replace("fpu sse2", "sse2 fpu"))
    assert cpu_build.cpu_identity(X86) == same == "model name=AMD EPYC;flags=avx2 avx512f fpu sse2"
    assert cpu_build.cpu_identity(X86.replace(" avx512f", "")) != cpu_build.cpu_identity(X86)
    arm = "processor : 0\nFeatures : fp asimd sve\nCPU implementer : 0x41\nCPU part : 0xd40\n"
    assert cpu_build.cpu_identity(arm) == "Features=asimd fp sve;CPU implementer=0x41;CPU part=0xd40"
    monkeypatch.setattr(cpu_build.platform, "node", lambda: "another-host")
    assert cpu_build.cpu_kernels.__wrapped__()._name == cpu_build.cpu_kernels()._name  # same file, no rebuild


@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "head_dim"),
                         [(16, 9, 3, 64), (4, 8, 2, 32), (32, 4, 4, 128), (16, 12, 1, 16), (8, 16, 2, 48),
                          (16, 14, 2, 64), (8, 5, 1, 256)])
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("query_scale", [1.0, 40.0])
def test_paged_prefill_attention_matches_the_causal_reference(block_size, num_heads, num_kv_heads, head_dim,
                                                              num_threads, query_scale,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # chunks: a whole prompt, one after a cached context (not block-aligned), one of a single token,
    # one shorter than a tile, one over several tiles and blocks after a context. Group sizes 7 and 5
    # leave padding rows in every tile (a tile holds 48 // G tokens); query_scale 40 spreads the
    # scores so far that most probabilities underflow to 0 (the exp's clamp) and the row maximum
    # jumps between softmax steps.
    monkeypatch.setattr(torch, "get_num_threads", lambda: num_threads)
    gen = torch.Generator().manual_seed(block_size + head_dim)
    seq_lens, chunk_lens = [37, 100, 9, 5, 130], [37, 23, 1, 5, 71]
    blocks_each = -(-max(seq_lens) // block_size)
    num_blocks = blocks_each * len(seq_lens) + 2
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: blocks_each * len(seq_lens)].view(len(seq_lens), -1)
    order = [3, 0, 4, 2, 1]  # chunks in the query in another order than the sequences
    starts, row = {}, 2  # two unrelated rows first
    for i in order:
        starts[i], row = row, row + chunk_lens[i]
    query = torch.randn(row + 1, num_heads, head_dim, generator=gen) * query_scale
    args = (query, kv_cache, torch.tensor([starts[i] for i in order]), torch.tensor([chunk_lens[i] for i in order]),
            torch.tensor(order), tables.int().contiguous(), torch.tensor(seq_lens, dtype=torch.int32), head_dim**-0.5)
    out, expected = torch.zeros_like(query), torch.zeros_like(query)
    paged_prefill_attention(*args, out)
    paged_prefill_attention_ref(*args, expected)
    # scores of magnitude ~100 carry ~1e-5 of float32 rounding into their probabilities (either side)
    torch.testing.assert_close(out, expected, atol=2e-6 if query_scale == 1 else 1e-4, rtol=1e-5)
    assert out[:2].abs().sum() == 0 and out[-1].abs().sum() == 0  # rows of no chunk are left alone
