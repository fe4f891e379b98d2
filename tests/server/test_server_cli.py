"""`conveyor serve` flags: server flags map onto ServerConfig, engine flags are the shared vLLM ones."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from conveyor.cli import build_parser
from conveyor.config import ConfigError
from conveyor.server.server_config import ServerConfig
from conveyor.engine.args import engine_config_from_args
from conveyor.server.cli import server_config_from_args

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"


def parse(*argv: str):  # noqa: ANN201
    return build_parser("serve").parse_args(["serve", *argv])


def test_defaults_come_from_server_config() -> None:
    assert server_config_from_args(parse()) == ServerConfig()


def test_server_and_engine_flags() -> None:
    args = parse("--host", "0.0.0.0", "--port", "0", "--api-key", "k", "--shutdown-grace", "2.5",
                  "--max-num-seqs", "4", "--max-num-queued-reqs", "3", "--queue-timeout", "1.5",
                  "--max-num-queued-tokens", "4096", "--api-server-count", "2")
    assert server_config_from_args(args) == ServerConfig(host="0.0.0.0", port=0, api_keys=("k",), shutdown_grace_s=2.5,
                                                         api_server_count=2)
    engine = engine_config_from_args(args)
    assert engine.scheduler.max_num_seqs == 4 and engine.scheduler.max_num_queued_reqs == 3
    assert engine.scheduler.queue_timeout_s == 1.5 and engine.scheduler.max_num_queued_tokens == 4096


def test_bad_server_flag_names_the_field() -> None:
    with pytest.raises(ConfigError, match="--port must be in"):
        server_config_from_args(parse("--port", "70000"))
    with pytest.raises(ConfigError, match="--api-server-count must be >= 1"):
        server_config_from_args(parse("--api-server-count", "0"))


def test_bad_flag_exits_2_before_loading_the_engine() -> None:
    code = ("import sys; from conveyor.cli import main; rc = main(['serve', '--shutdown-grace', '-1']); "
            "sys.exit(10 + rc if 'torch' not in sys.modules else 99)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(SRC)})
    assert result.returncode == 12, result.stderr
    assert "--shutdown-grace must be >= 0" in result.stderr


@pytest.mark.slow  # spawns the engine process
def test_engine_start_up_failure_is_one_clean_line_and_exit_1(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "not-a-model.gguf"
    missing.write_bytes(b"this is no GGUF file")
    code = ("import sys; from conveyor.cli import main; rc = main(['serve', '--model', sys.argv[1], '--port', '0']); "
            "sys.exit(10 + rc if 'torch' not in sys.modules else 99)")
    # PATH: the engine process builds the CPU kernels before it opens the model, and without PATH the C
    # compiler finds no linker (minutes of a failing build on a busy machine, then the same error)
    env = {"PYTHONPATH": str(SRC), "PATH": os.environ.get("PATH", os.defpath)}
    result = subprocess.run([sys.executable, "-c", code, str(missing)], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 11, result.stderr  # exit 1, and the launching process never loaded torch
    line = [x for x in result.stderr.splitlines() if x.startswith("conveyor serve: error:")]
    assert len(line) == 1 and "the engine failed to start" in line[0] and str(missing) in line[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("num_cores", "api_server_count", "expected"), [
    (1, 1, 1), (1, 4, 1),                # one core: one thread, whatever the API servers
    (2, 1, 2), (2, 2, 2),                # two cores: both, measured faster than leaving one free
    (4, 1, 3), (4, 2, 2), (4, 8, 2),     # a core per API server left free, at least two threads
    (16, 1, 15), (16, 4, 12), (16, 32, 2),
])
def test_cpu_thread_default_leaves_the_api_servers_cores_but_takes_two(num_cores: int, api_server_count: int,
                                                                         expected: int) -> None:
    from conveyor.server.cli import default_cpu_threads

    assert default_cpu_threads(num_cores, api_server_count) == expected


def test_on_cpu_the_engine_gets_the_default_threads_unless_the_flag_says(monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.server.cli import leave_cores_to_api_servers

    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0, 1, 2, 3})
    config = engine_config_from_args(parse())
    assert leave_cores_to_api_servers(config, 1).device.num_threads == 3
    assert leave_cores_to_api_servers(config, 2).device.num_threads == 2
    assert leave_cores_to_api_servers(config, 8).device.num_threads == 2
    for flag in ("1", "4"):
        given = engine_config_from_args(parse("--num-threads", flag))
        assert leave_cores_to_api_servers(given, 1).device.num_threads == int(flag)  # the flag wins
    ranks = engine_config_from_args(parse("--tensor-parallel-size", "2"))
    assert leave_cores_to_api_servers(ranks, 1).device.num_threads == 1  # 3 engine threads over 2 ranks
    cuda = engine_config_from_args(parse("--device", "cuda"))
    assert leave_cores_to_api_servers(cuda, 1).device.num_threads is None


@pytest.mark.parametrize(("model", "expected"), [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "looks like a Hugging Face hub id, and conveyor has no hub access"),
    ("./no/such/dir", "no such file or directory"),
])
def test_a_model_that_is_not_local_is_one_line_and_exit_2(model: str, expected: str) -> None:
    code = ("import sys; from conveyor.cli import main; rc = main(['serve', sys.argv[1]]); "
            "sys.exit(10 + rc if 'torch' not in sys.modules else 99)")
    result = subprocess.run([sys.executable, "-c", code, model], capture_output=True, text=True,
                            env={"PYTHONPATH": str(SRC)}, timeout=60)
    assert result.returncode == 12, result.stderr
    assert result.stderr.count("\n") == 1 and expected in result.stderr and "Traceback" not in result.stderr
    assert "pass a local Hugging Face directory or a GGUF file" in result.stderr


@pytest.mark.parametrize("tokenizer", ["/nonexistent/tok", "/etc/hostname"])
def test_a_bad_tokenizer_is_one_line_before_the_engine_starts(tokenizer: str) -> None:
    """It was a 33-line traceback once the engine had loaded the model."""
    code = ("import sys; from conveyor.cli import main; rc = main(['serve', '--tokenizer', sys.argv[1]]); "
            "sys.exit(10 + rc if 'torch' not in sys.modules else 99)")
    result = subprocess.run([sys.executable, "-c", code, tokenizer], capture_output=True, text=True,
                            env={"PYTHONPATH": str(SRC)}, timeout=120)
    lines = result.stderr.splitlines()  # the engine's start-up would log lines of its own
    assert result.returncode == 12 and len(lines) == 1, result.stderr
    assert "--tokenizer" in lines[0] and tokenizer in lines[0]
