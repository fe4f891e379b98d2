"""Engine flags: vLLM names map onto EngineConfig; defaults come from the dataclasses; bad values name the flag."""

from __future__ import annotations

import argparse
import json

import pytest

from conveyor.config import (
    Batching, CUDAGraphMode, EngineConfig, LoadFormat, Quantization, SchedulingPolicy, SpeculativeConfig,
    SpeculativeMethod,
)
from conveyor.engine.args import (
    add_engine_arguments,
    build_engine_config,
    engine_config_from_args,
    engine_config_to_flags,
    parse_memory_bytes,
)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="t")
    add_engine_arguments(parser)
    return parser.parse_args(argv)


def test_no_flags_gives_dataclass_defaults() -> None:
    assert build_engine_config(parse([])) == EngineConfig()


def test_flags_map_onto_fields() -> None:
    config = build_engine_config(parse([
        "m.gguf", "--max-model-len", "1024", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
        "--no-enable-prefix-caching", "--long-prefill-token-threshold", "64", "--block-size", "32",
        "--kv-cache-memory", "64MiB", "--scheduling-policy", "priority", "--batching", "static",
        "--load-format", "dummy", "--max-num-queued-reqs", "10", "--queue-timeout", "2.5", "--seed", "7",
    ]))
    assert config.model.model == "m.gguf" and config.model.load_format is LoadFormat.DUMMY
    assert config.model.seed == 7
    s = config.scheduler
    assert (s.max_model_len, s.max_num_seqs, s.max_num_batched_tokens) == (1024, 8, 512)
    assert s.long_prefill_token_threshold == 64 and s.policy is SchedulingPolicy.PRIORITY
    assert s.batching is Batching.STATIC and s.max_num_queued_reqs == 10 and s.queue_timeout_s == 2.5
    assert config.cache.block_size == 32 and not config.cache.enable_prefix_caching
    assert config.cache.kv_cache_memory_bytes == 64 * 2**20


def test_cuda_graph_flags_map_onto_device_config(capsys: pytest.CaptureFixture[str]) -> None:
    device = build_engine_config(parse(["--cudagraph-mode", "full_decode_only",
                                        "--max-cudagraph-capture-size", "512"])).device
    assert device.cudagraph_mode is CUDAGraphMode.FULL_DECODE_ONLY and device.max_cudagraph_capture_size == 512
    assert EngineConfig().device.cudagraph_mode is CUDAGraphMode.FULL
    with pytest.raises(SystemExit):
        engine_config_from_args(parse(["--max-cudagraph-capture-size", "0"]))
    assert "--max-cudagraph-capture-size" in capsys.readouterr().err


def test_async_scheduling_flag_and_its_static_conflict(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_engine_config(parse(["--async-scheduling"])).scheduler.async_scheduling
    assert not EngineConfig().scheduler.async_scheduling
    with pytest.raises(SystemExit):
        engine_config_from_args(parse(["--async-scheduling", "--batching", "static"]))
    err = capsys.readouterr().err
    assert "--async-scheduling" in err and "--batching" in err


def test_cuda_takes_vllms_gpu_defaults_and_async_scheduling() -> None:
    cuda = build_engine_config(parse(["--device", "cuda"])).scheduler
    assert (cuda.max_num_seqs, cuda.max_num_batched_tokens, cuda.async_scheduling) == (1024, 8192, True)
    cpu = build_engine_config(parse([])).scheduler
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens, cpu.async_scheduling) == (128, 2048, False)


def test_given_flags_win_over_the_cuda_defaults() -> None:
    config = build_engine_config(parse(["--device", "cuda", "--no-async-scheduling", "--max-num-seqs", "256",
                                        "--max-num-batched-tokens", "2048"])).scheduler
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.async_scheduling) == (256, 2048, False)
    static = build_engine_config(parse(["--device", "cuda", "--batching", "static"])).scheduler
    assert not static.async_scheduling  # async needs continuous batching: not defaulted on there


def test_zero_threshold_means_no_cap_as_in_vllm() -> None:
    assert build_engine_config(parse(["--long-prefill-token-threshold", "0"])).scheduler \
        .long_prefill_token_threshold is None


@pytest.mark.parametrize(("text", "expected"), [("1024", 1024), ("1GiB", 2**30), ("2G", 2 * 10**9),
                                                ("512mib", 512 * 2**20)])
def test_memory_sizes(text: str, expected: int) -> None:
    assert parse_memory_bytes(text) == expected


def test_bad_value_is_a_parser_error_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        engine_config_from_args(parse(["--max-num-seqs", "0"]))
    assert exit_info.value.code == 2
    assert "--max-num-seqs" in capsys.readouterr().err


def test_cross_field_error_names_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        engine_config_from_args(parse(["--max-num-seqs", "64", "--max-num-batched-tokens", "32"]))
    err = capsys.readouterr().err
    assert "--max-num-batched-tokens" in err and "--max-num-seqs" in err


def test_bad_memory_size_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--kv-cache-memory", "lots"])
    assert "--kv-cache-memory" in capsys.readouterr().err


def test_positional_and_flag_model_must_agree() -> None:
    with pytest.raises(SystemExit):
        engine_config_from_args(parse(["a.gguf", "--model", "b.gguf"]))


def test_resolved_config_as_flag_strings() -> None:
    flat = engine_config_to_flags(EngineConfig())
    assert flat["max-num-seqs"] == "128" and flat["batching"] == "continuous"
    assert flat["enable-prefix-caching"] == "true" and flat["queue-timeout"] == "none"


def test_quantization_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert EngineConfig().model.quantization is Quantization.AUTO
    assert build_engine_config(parse(["--quantization", "none"])).model.quantization is Quantization.NONE
    assert build_engine_config(parse(["-q", "gguf"])).model.quantization is Quantization.GGUF
    assert engine_config_to_flags(EngineConfig())["quantization"] == "auto"
    with pytest.raises(SystemExit):
        parse(["--quantization", "awq"])
    assert "--quantization" in capsys.readouterr().err


def test_speculative_config_flag_takes_vllm_json(capsys: pytest.CaptureFixture[str]) -> None:
    config = build_engine_config(parse(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, '
                                        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}']))
    spec = config.speculative_config
    assert spec is not None and spec.method is SpeculativeMethod.NGRAM
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 2, 5)
    assert json.loads(engine_config_to_flags(config)["speculative-config"]) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    draft = build_engine_config(parse(["--speculative-config",
                                       '{"method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 3}']))
    assert draft.speculative_config == SpeculativeConfig(SpeculativeMethod.DRAFT_MODEL, 3, model="d.gguf")
    assert engine_config_to_flags(EngineConfig())["speculative-config"] == "none"


@pytest.mark.parametrize(("value", "message"), [
    ('{"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}', "unknown key 'lookahead'"),
    ('{"method": "eagle", "num_speculative_tokens": 3}', "'method' 'eagle' is a vLLM method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "'num_speculative_tokens' must be in 1..128"),
    ('{"method": "ngram"}', "'num_speculative_tokens' is required"),
    ("[1, 2]", "expected a JSON object"),
    ("{method: ngram}", "not valid JSON"),
])
def test_bad_speculative_config_names_the_flag_and_the_key(capsys: pytest.CaptureFixture[str], value: str,
                                                            message: str) -> None:
    with pytest.raises(SystemExit):
        parse(["--speculative-config", value])
    err = capsys.readouterr().err
    assert "--speculative-config" in err and message in err


def test_speculative_decoding_refuses_async_scheduling(capsys: pytest.CaptureFixture[str]) -> None:
    ngram = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    with pytest.raises(SystemExit):
        engine_config_from_args(parse(["--async-scheduling", *ngram]))
    err = capsys.readouterr().err
    assert "--speculative-config" in err and "--async-scheduling" in err
    on_cuda = build_engine_config(parse(["--device", "cuda", *ngram]))  # CUDA's async default steps aside
    assert not on_cuda.scheduler.async_scheduling and on_cuda.scheduler.max_num_seqs == 1024
    assert build_engine_config(parse(["--device", "cuda"])).scheduler.async_scheduling


def test_tensor_parallel_size_flag(capsys: pytest.CaptureFixture[str]) -> None:
    config = build_engine_config(parse(["-tp", "2"]))
    assert config.parallel.tensor_parallel_size == 2
    assert engine_config_to_flags(config)["tensor-parallel-size"] == "2"
    assert build_engine_config(parse(["--tensor-parallel-size", "4"])).parallel.tensor_parallel_size == 4
    with pytest.raises(SystemExit):
        engine_config_from_args(parse(["--tensor-parallel-size", "0"]))
    assert "--tensor-parallel-size must be >= 1" in capsys.readouterr().err
    ngram = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    with pytest.raises(SystemExit):
        engine_config_from_args(parse(["-tp", "2", *ngram]))
    err = capsys.readouterr().err
    assert "--speculative-config" in err and "--tensor-parallel-size > 1" in err
