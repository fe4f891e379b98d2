"""benchmarks/gpu/step_split.py: the split of a step log by step kind (decode, mixed, prefill)."""

import json
import pathlib

import pytest
from script_loader import load_script

from conveyor.core.step_log import StepRecord


def _script():
    return load_script("gpu/step_split.py")


def _step(prefill_tokens: int, decode_reqs: int, ms: float) -> StepRecord:
    return StepRecord(num_prefill_tokens=prefill_tokens, num_decode_tokens=decode_reqs,
                      num_prefill_reqs=1 if prefill_tokens else 0, num_decode_reqs=decode_reqs,
                      num_context_tokens=100 * decode_reqs + prefill_tokens, step_time_s=ms / 1e3)


def test_kinds_shares_and_means() -> None:
    split = _script()
    records = [_step(0, 10, 10.0), _step(0, 30, 20.0), _step(512, 20, 50.0), _step(1024, 0, 20.0)]
    rows = {row.kind: row for row in split.summarize(records)}
    assert list(rows) == ["decode", "mixed", "prefill"]
    assert rows["decode"].num_steps == 2 and rows["decode"].mean_step_ms == pytest.approx(15.0)
    assert rows["decode"].mean_decode_reqs == pytest.approx(20.0)
    assert rows["mixed"].busy_share == pytest.approx(0.5) and rows["mixed"].mean_prefill_tokens == 512
    assert rows["prefill"].busy_share == pytest.approx(0.2)
    assert sum(row.busy_share for row in rows.values()) == pytest.approx(1.0)


def test_reads_the_servers_lines_and_prints_a_table(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    split = _script()
    log = tmp_path / "step_log_c_r16.jsonl"
    log.write_text("".join(json.dumps(_step(0, 8, 12.0).to_json()) + "\n" for _ in range(3)))
    (tmp_path / "empty.jsonl").write_text("")
    assert split.main([str(log), str(tmp_path / "empty.jsonl")]) == 0
    out, err = capsys.readouterr()
    assert "step_log_c_r16.jsonl: 3 steps" in out and "decode       3  100.0    12.00" in out
    assert "no steps" in err
