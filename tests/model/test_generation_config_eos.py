"""The model's EOS ids: generation_config.json's `eos_token_id` (int or list) where the model directory has
one naming it, else config.json's, as vLLM reads them (--generation-config auto)."""

from __future__ import annotations

import json
import pathlib

import pytest

from conveyor.config import LoadFormat, ModelConfig
from conveyor.model.loader import read_arch_config
from conveyor.model.registry import eos_token_ids_of

TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "eos_token_id": [1, 2]}


def _eos(directory: pathlib.Path, generation_config: dict | None, **config: object) -> tuple[int, ...]:
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**TINY, **config}))
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config))
    return read_arch_config(ModelConfig(model=str(directory), load_format=LoadFormat.DUMMY)).eos_token_ids


@pytest.mark.parametrize(("value", "ids"), [(None, ()), (7, (7,)), ([7, 9], (7, 9)), ([], ())])
def test_an_eos_token_id_is_an_int_or_a_list(value: object, ids: tuple[int, ...]) -> None:
    assert eos_token_ids_of(value) == ids


def test_generation_config_list_wins_over_config(tmp_path: pathlib.Path) -> None:
    assert _eos(tmp_path, {"eos_token_id": [151645, 151643], "temperature": 0.6}) == (151645, 151643)


def test_generation_config_int_wins_over_config(tmp_path: pathlib.Path) -> None:
    assert _eos(tmp_path, {"eos_token_id": 9}) == (9,)


def test_config_json_without_generation_config(tmp_path: pathlib.Path) -> None:
    assert _eos(tmp_path, None) == (1, 2)
    assert _eos(tmp_path / "int", None, eos_token_id=3) == (3,)


def test_generation_config_without_eos_keeps_config_json(tmp_path: pathlib.Path) -> None:
    assert _eos(tmp_path, {"temperature": 0.6}) == (1, 2)


def test_generation_config_path_names_the_eos_ids(tmp_path: pathlib.Path) -> None:
    """--generation-config PATH: vLLM reads PATH's generation_config.json, its eos_token_id included."""
    _eos(tmp_path / "model", {"eos_token_id": 9})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    model = ModelConfig(model=str(tmp_path / "model"), load_format=LoadFormat.DUMMY, generation_config=str(elsewhere))
    assert read_arch_config(model).eos_token_ids == (5, 6)


def test_generation_config_vllm_still_reads_the_models_eos_ids(tmp_path: pathlib.Path) -> None:
    """--generation-config vllm drops the sampling defaults only: vLLM's `try_get_generation_config` reads the
    model's file for "auto" and "vllm" alike, and its processor stops on those EOS ids."""
    _eos(tmp_path, {"eos_token_id": 9})
    model = ModelConfig(model=str(tmp_path), load_format=LoadFormat.DUMMY, generation_config="vllm")
    assert read_arch_config(model).eos_token_ids == (9,)
