"""--generation-config / --override-generation-config: which file vLLM reads, which keys become default
sampling parameters, how the override merges, and the one-line errors naming the flag."""

from __future__ import annotations

import json
import logging
import pathlib

import pytest

from conveyor.cli import build_parser
from conveyor.config import ConfigError, LoadFormat, ModelConfig
from conveyor.engine.args import build_engine_config
from conveyor.engine.generation_defaults import (
    SamplingDefaults,
    log_sampling_defaults,
    sampling_defaults_of,
)
from conveyor.engine.vllm_flags import check_vllm_flags, preprocess_argv

LLAMA_31 = {"temperature": 0.6, "top_p": 0.9, "do_sample": True, "eos_token_id": [128001, 128008, 128009]}
"""Llama-3.1-8B-Instruct's generation_config.json (its sampling keys)."""


def _folder(path: pathlib.Path, generation_config: dict | None, config: dict | None = None) -> pathlib.Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or {"architectures": ["LlamaForCausalLM"]}))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def _defaults(argv: list[str]) -> SamplingDefaults:
    args = build_parser("serve").parse_args(["serve", *preprocess_argv(argv)])
    check_vllm_flags(args)
    return sampling_defaults_of(build_engine_config(args).model)


def test_auto_reads_the_models_generation_config(tmp_path: pathlib.Path) -> None:
    model = _folder(tmp_path, LLAMA_31)
    assert _defaults([str(model)]) == SamplingDefaults(temperature=0.6, top_p=0.9)
    assert _defaults([str(model), "--generation-config", "auto"]) == SamplingDefaults(temperature=0.6, top_p=0.9)


def test_auto_without_a_generation_config_takes_config_jsons_keys(tmp_path: pathlib.Path) -> None:
    assert _defaults([str(_folder(tmp_path / "a", None))]) == SamplingDefaults()
    model = _folder(tmp_path / "b", None, {"architectures": ["LlamaForCausalLM"], "repetition_penalty": 1.1})
    assert _defaults([str(model)]) == SamplingDefaults(repetition_penalty=1.1)


def test_a_gguf_or_the_embedded_model_has_no_defaults() -> None:
    assert _defaults([]) == SamplingDefaults()


def test_every_sampling_key_and_max_new_tokens(tmp_path: pathlib.Path) -> None:
    model = _folder(tmp_path, {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
                               "repetition_penalty": 1.05, "max_new_tokens": 64, "num_beams": 1})
    assert _defaults([str(model)]) == SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.05,
                                                       repetition_penalty=1.05, max_tokens=64)


def test_transformers_own_defaults_in_the_file_are_no_defaults(tmp_path: pathlib.Path) -> None:
    """vLLM reads the file through transformers 4's `to_diff_dict`: `top_k: 50` (its default) is dropped."""
    model = _folder(tmp_path, {"temperature": 1.0, "top_k": 50, "top_p": 0.95})
    assert _defaults([str(model)]) == SamplingDefaults(top_p=0.95)
    assert _defaults([str(model), "--override-generation-config", '{"top_k": 50}']).top_k == 50


def test_vllm_reads_no_generation_config(tmp_path: pathlib.Path) -> None:
    model = _folder(tmp_path, LLAMA_31)
    assert _defaults([str(model), "--generation-config", "vllm"]) == SamplingDefaults()
    assert _defaults([str(model), "--generation-config", "vllm", "--override-generation-config",
                      '{"temperature": 0.3}']) == SamplingDefaults(temperature=0.3)


def test_a_path_is_read_instead_of_the_model(tmp_path: pathlib.Path) -> None:
    model = _folder(tmp_path / "model", LLAMA_31)
    other = _folder(tmp_path / "other", {"temperature": 0.2, "max_new_tokens": 32})
    # PATH's max_new_tokens is a default and a cap (vLLM's override_max_tokens).
    assert _defaults([str(model), "--generation-config", str(other)]) == \
        SamplingDefaults(temperature=0.2, max_tokens=32, max_tokens_cap=32)


def test_the_override_merges_over_the_file(tmp_path: pathlib.Path) -> None:
    model = _folder(tmp_path, LLAMA_31)
    merged = _defaults([str(model), "--override-generation-config",
                        '{"temperature": 0.5, "top_p": null, "max_new_tokens": 100, "do_sample": false}'])
    # null removes the file's value (vLLM merges, then keeps the keys that are not None).
    assert merged == SamplingDefaults(temperature=0.5, max_tokens=100, max_tokens_cap=100)


@pytest.mark.parametrize(("argv", "flag", "says"), [
    (["--override-generation-config", "{temperature"], "--override-generation-config", "not valid JSON"),
    (["--override-generation-config", "[1]"], "--override-generation-config", "JSON object"),
    (["--override-generation-config", '{"temperature": "hot"}'], "--override-generation-config", "a number"),
    (["--override-generation-config", '{"top_k": 2.5}'], "--override-generation-config", "an integer"),
    (["--generation-config", "{tmp}"], "--generation-config", "no generation_config.json"),
])
def test_bad_values_are_one_line_errors_naming_the_flag(argv: list[str], flag: str, says: str, tmp_path: pathlib.Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser("serve").parse_args(["serve", *[arg.replace("{tmp}", str(tmp_path)) for arg in argv]])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert flag in last and says in last


def test_an_unreadable_file_is_a_config_error_naming_the_flag(tmp_path: pathlib.Path) -> None:
    model = _folder(tmp_path, None)
    (model / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="--generation-config"):
        sampling_defaults_of(ModelConfig(model=str(model), load_format=LoadFormat.DUMMY))


def test_the_defaults_are_logged_once_like_vllm(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="conveyor.serve"):
        log_sampling_defaults(SamplingDefaults())
        assert not caplog.records
        log_sampling_defaults(SamplingDefaults(temperature=0.6, top_p=0.9))
    [record] = caplog.records
    assert "Default sampling parameters have been overridden" in record.getMessage()
    assert "'temperature': 0.6" in record.getMessage()
