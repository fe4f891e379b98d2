"""benchmarks/cpu_decode_profile.py (issue 39) runs end to end in its dry-run mode on the embedded model:
the RESULT line carries the step times, the op and C call counts, the split and the bandwidth floor."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from conveyor.kernels.cpu_build import cpu_kernels_available

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_decode_profile.py"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not cpu_kernels_available(), reason="needs the C CPU kernels")]


def test_dry_run_reports_split_and_floor() -> None:
    path = os.pathsep.join([str(SCRIPT.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--threads", "1"], cwd=SCRIPT.parent,
                          env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["step_ms_median"] > 0 and result["op_calls_per_step"] > 0
    assert result["c_calls_per_step"] >= 2  # the decoder stack and the LM head at least
    assert result["split_ms"]["c:decoder_stack"] > 0 and result["split_ms"]["c:q8_0_matmul"] > 0
    assert 0.99 < sum(result["stack_shares"][k] for k in ("matmul", "attention", "rest")) < 1.01
    assert result["weight_mb_resident"] > result["weight_mb_gguf"] > 50  # SmolLM2-135M in Q4_1 / Q8_0 blocks
    assert result["floor_ms_gguf"] > 0 and "engine_gap_ms" in result
