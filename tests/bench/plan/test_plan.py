"""The GPU plan's arithmetic against hand-computed cases."""

from __future__ import annotations

import json
import pathlib

import pytest

from conveyor.bench.cli import plan as cli_plan
from conveyor.bench.plan.gpu_catalog import (
    CatalogError,
    find_gpu,
    parse_prices,
    priced_catalog,
)
from conveyor.bench.plan.memory import (
    PlanError,
    PlanInputs,
    count_parameters,
    fit_on,
    kv_bytes_per_token,
    kv_capacity,
    load_shape,
    model_memory,
    shape_per_rank,
)
from conveyor.bench.plan.sampler_memory import sampler_bytes, unchunked_sampler_bytes

MODELS = pathlib.Path(__file__).parents[1] / "fixtures" / "models"


def test_llama_8b_weights_and_kv_per_token() -> None:
    shape = load_shape(MODELS / "llama-3.1-8b")
    params = count_parameters(shape)
    # embed 128256*4096 twice (untied); per layer 41_943_040 attention + 176_160_768 MLP + 8192 norms.
    assert params.total == 8_030_261_248
    weights = model_memory(shape, PlanInputs(dtype="bfloat16")).weights_bytes
    assert weights == 16_060_522_496  # ~16.06e9 bytes = 14.96 GiB
    assert round(weights / 2**30, 1) == 15.0
    assert kv_bytes_per_token(shape, 2) == 131072  # 2 * 32 layers * 8 kv heads * 128 * 2 bytes


def test_qwen3_tied_with_qk_norm() -> None:
    shape = load_shape(MODELS / "qwen3-0.6b")
    params = count_parameters(shape)
    assert params.lm_head == 0
    # 28 layers: q 1024x2048, k,v 1024x1024, o 2048x1024, q/k norm 2x128; MLP 3x1024x3072; 2 norms of 1024.
    per_layer_attention = 1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 256
    assert params.attention == 28 * per_layer_attention
    assert params.total == 151936 * 1024 + 28 * (per_layer_attention + 3 * 1024 * 3072 + 2048) + 1024
    assert 0.59e9 < params.total < 0.61e9
    assert kv_bytes_per_token(shape, 2) == 2 * 28 * 8 * 128 * 2


def test_fit_on_gpus() -> None:
    shape = load_shape(MODELS / "llama-3.1-8b")
    inputs = PlanInputs(max_num_seqs=64, context_len=8192)
    memory = model_memory(shape, inputs)
    assert memory.kv_bytes_per_request == 8192 * 131072
    assert memory.kv_needed_bytes == 64 * 8192 * 131072  # 64 GiB
    h100, h200, rtx = (fit_on(find_gpu(n), memory, inputs) for n in ("H100", "H200", "RTX5090"))
    assert not h100.fits and h200.fits and not rtx.fits
    assert h200.kv_headroom_bytes == h200.kv_budget_bytes - memory.kv_needed_bytes
    assert h200.max_concurrency == h200.kv_budget_bytes // memory.kv_bytes_per_request
    assert 64 < h200.max_concurrency < 120 and 30 < h100.max_concurrency < 64
    assert rtx.max_concurrency <= 16


def test_tensor_parallel_splits_weights_and_kv() -> None:
    shape = load_shape(MODELS / "llama-3.1-8b")
    one, two = (model_memory(shape, PlanInputs(tensor_parallel_size=tp)) for tp in (1, 2))
    norms = 32 * 2 * 4096 + 4096  # replicated on every rank
    assert two.weights_bytes == ((8_030_261_248 - norms) // 2 + norms) * 2
    assert two.kv_bytes_per_token == one.kv_bytes_per_token // 2
    assert two.num_parameters == one.num_parameters


def test_shape_per_rank_follows_the_engine_split() -> None:
    smol = load_shape(MODELS / "smollm2-135m")  # 9 heads, 3 KV heads: 2 + 1 KV heads over 2 ranks
    rank = shape_per_rank(smol, 2)
    assert (rank.num_heads, rank.num_kv_heads, rank.intermediate_size, rank.vocab_size) == (6, 2, 768, 24576)
    llama = load_shape(MODELS / "llama-3.1-8b")  # 8 KV heads over 16 ranks: each replicated on 2
    assert (shape_per_rank(llama, 16).num_heads, shape_per_rank(llama, 16).num_kv_heads) == (2, 1)
    assert shape_per_rank(llama, 1) == llama
    with pytest.raises(PlanError, match="--tensor-parallel-size 12"):
        shape_per_rank(llama, 12)  # fewer KV heads than ranks and not a multiple of them


def test_kv_capacity_per_rank() -> None:
    shape = load_shape(MODELS / "smollm2-135m")
    plan = kv_capacity(shape_per_rank(shape, 2), 1 << 30, 16, "float32", 2048)
    assert plan.bytes_per_block == 2 * 30 * 16 * 2 * 64 * 4  # rank 0 caches 2 of the 3 KV heads
    assert plan.num_blocks == (1 << 30) // plan.bytes_per_block


def test_kv_capacity_matches_serve_arithmetic() -> None:
    shape = load_shape(MODELS / "smollm2-135m")
    plan = kv_capacity(shape, 1 << 30, 16, "float32", 2048)
    assert plan.bytes_per_block == 2 * 30 * 16 * 3 * 64 * 4
    assert plan.num_blocks == (1 << 30) // plan.bytes_per_block == 1456
    assert plan.max_concurrency == pytest.approx(1456 / 128)


def test_prices_and_bad_input(tmp_path: pathlib.Path) -> None:
    (tmp_path / "p.json").write_text(json.dumps({"h200": 3.5}))
    prices = parse_prices(["H100=2.5", str(tmp_path / "p.json")])
    assert prices == {"H100": 2.5, "H200": 3.5}
    assert priced_catalog(prices, ["h100"])[0].price_per_hour == 2.5
    with pytest.raises(CatalogError, match="unknown GPU"):
        parse_prices(["V100=1"])
    with pytest.raises(PlanError, match="--context-len"):
        PlanInputs(context_len=0)


def test_cli_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    parser = __import__("argparse").ArgumentParser()
    cli_plan.add_arguments(parser)
    args = parser.parse_args(["--config", str(MODELS / "llama-3.1-8b"), "--price", "H200=3", "--json"])
    assert cli_plan.run(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["weights_bytes"] == 16_060_522_496
    h200 = next(g for g in data["gpus"] if g["gpu"] == "H200")
    assert isinstance(h200["kv_budget_bytes"], int) and h200["price_per_hour"] == 3.0
    args = parser.parse_args(["--config", str(MODELS / "smollm2-135m"), "--kv-cache-memory", "1GiB"])
    assert cli_plan.run(args) == 0
    assert "1456 blocks" in capsys.readouterr().out
    args = parser.parse_args(["--config", str(MODELS / "smollm2-135m"), "--kv-cache-memory", "1GiB",
                              "--tensor-parallel-size", "2"])
    assert cli_plan.run(args) == 0
    assert f"per rank of 2: 1.00 GiB / {2 * 30 * 16 * 2 * 64 * 4} bytes per block" in capsys.readouterr().out
    args = parser.parse_args(["--config", str(MODELS / "llama-3.1-8b"), "--gpu", "H100"])
    assert cli_plan.run(args) == 0
    assert "H100" in capsys.readouterr().out


def test_config_fields_are_checked_where_they_are_read(tmp_path: pathlib.Path) -> None:
    config = json.loads((MODELS / "qwen3-0.6b" / "config.json").read_text())
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(dict(config, num_hidden_layers=None)))
    with pytest.raises(PlanError, match="'num_hidden_layers' must be a number"):
        load_shape(bad)
    bad.write_text(json.dumps([config]))
    with pytest.raises(PlanError, match="must be a JSON object"):
        load_shape(bad)
    bad.write_text(json.dumps(dict(config, head_dim=None, num_key_value_heads=None)))
    shape = load_shape(bad)  # null optional fields take their defaults, as HF configs leave them
    assert (shape.head_dim, shape.num_kv_heads) == (config["hidden_size"] // config["num_attention_heads"],
                                                    config["num_attention_heads"])


def test_fp8_weights_take_one_byte_per_projection_weight() -> None:
    """`conveyor plan --quantization fp8`: attention and MLP weights at 1 byte, embedding, LM head and norms
    at --dtype (as model/fp8_weights.py quantizes them)."""
    from conveyor.bench.plan.memory import count_parameters, model_memory

    shape = load_shape(MODELS / "llama-3.1-8b")
    params = count_parameters(shape)
    bf16 = model_memory(shape, PlanInputs(dtype="bfloat16")).weights_bytes
    fp8 = model_memory(shape, PlanInputs(dtype="bfloat16", quantization="fp8")).weights_bytes
    assert bf16 == 2 * params.total
    assert fp8 == 2 * (params.embedding + params.lm_head + params.norms) + params.attention + params.mlp
    assert 0.55 < fp8 / bf16 < 0.6  # Llama-3.1-8B: 6.98 of 8.03 B parameters are projections
    assert model_memory(shape, PlanInputs(dtype="bfloat16", quantization="ptpc_fp8")).weights_bytes == fp8
    with pytest.raises(PlanError, match="--quantization"):
        PlanInputs(quantization="int4")


def test_a_checkpoint_stored_in_fp8_is_planned_in_fp8(tmp_path: pathlib.Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """As serve loads an FP8 checkpoint in FP8 without --quantization fp8 (model/fp8_checkpoint.py)."""
    config = json.loads((MODELS / "llama-3.1-8b" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    assert load_shape(tmp_path).stored_fp8 and not load_shape(MODELS / "llama-3.1-8b").stored_fp8
    parser = __import__("argparse").ArgumentParser()
    cli_plan.add_arguments(parser)
    sizes = []
    for flags in ([str(tmp_path)], [str(MODELS / "llama-3.1-8b"), "--quantization", "fp8"]):
        assert cli_plan.run(parser.parse_args(["--config", *flags, "--json"])) == 0
        sizes.append(json.loads(capsys.readouterr().out)["model"]["weights_bytes"])
    assert sizes[0] == sizes[1] < 16_060_522_496
    assert cli_plan.run(parser.parse_args(["--config", str(tmp_path), "--quantization", "none"])) == 2
    assert "contradicts" in capsys.readouterr().err


@pytest.mark.parametrize(("rows", "vocab_size", "measured_gib"), [
    (256, 128_256, 0.5378), (1024, 128_256, 1.2684), (256, 151_936, 0.5811), (1024, 151_936, 1.4503),
])
def test_the_sampler_model_reproduces_the_measured_peaks_within_one_percent(rows: int, vocab_size: int,
                                                                         measured_gib: float) -> None:
    # One chunked sampler call's peak beyond the LM head's logits, measured on an H200 (docs/performance.md).
    assert sampler_bytes(rows, vocab_size) / (1 << 30) == pytest.approx(measured_gib, rel=0.01)


def test_the_unchunked_sampler_model_is_the_whole_batch_at_52_bytes_per_logit() -> None:
    assert unchunked_sampler_bytes(1024, 151_936) == 1024 * 151_936 * 52
    assert sampler_bytes(1, 151_936) == 151_936 * 56  # one row: no chunking, every temporary counted
