from __future__ import annotations

import argparse
import json
import pathlib

import pytest

from conveyor.config import Batching
from conveyor.core import simulate_cli
from conveyor.core.simulate import SimulationConfig, WorkloadConfig, compare, percentile, simulate

SMALL = SimulationConfig(workload=WorkloadConfig(num_requests=60, request_rate=6.0, long_fraction=0.15,
                                                 long_prompt_tokens=512, long_output_tokens=256))


def test_continuous_beats_static_on_a_mixed_workload() -> None:
    continuous, static = compare(SMALL)
    assert (continuous.batching, static.batching) == (Batching.CONTINUOUS, Batching.STATIC)
    assert continuous.num_completed == static.num_completed == 60
    assert continuous.completed_per_s > static.completed_per_s
    assert continuous.ttft_p95_s < static.ttft_p95_s / 5
    assert continuous.e2e_p95_s < static.e2e_p95_s


def test_simulation_is_deterministic() -> None:
    assert simulate(SMALL) == simulate(SMALL)


def test_percentile_interpolates() -> None:
    assert percentile([], 95) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)


def test_workload_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="request_rate"):
        WorkloadConfig(request_rate=0)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    simulate_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_prints_both_policies_and_writes_json(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    code = simulate_cli.run(_args("--num-requests", "20", "--long-prompt-tokens", "256", "--max-num-seqs", "8",
                                  "--output-json", str(out)))
    assert code == 0
    text = capsys.readouterr().out
    assert "continuous" in text and "static" in text and "TTFT p95" in text
    assert [row["batching"] for row in json.loads(out.read_text())] == ["continuous", "static"]


def test_cli_reports_bad_values_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate_cli.run(_args("--max-num-seqs", "0")) == 2
    assert "max_num_seqs" in capsys.readouterr().err
    assert simulate_cli.run(_args("--long-prompt-tokens", "5000", "--num-requests", "5", "--long-fraction", "1")) == 2
    assert "prompt" in capsys.readouterr().err
