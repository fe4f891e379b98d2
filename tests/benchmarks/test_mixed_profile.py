"""benchmarks/gpu/mixed_profile.py: the batches it builds and the bounds it prices (its timing needs CUDA)."""

import json
import pathlib

import pytest
from script_loader import load_script

MODELS = pathlib.Path(__file__).parents[2] / "benchmarks" / "models"


def _script():
    return load_script("gpu/mixed_profile.py")


def test_it_builds_a_decode_step_and_a_mixed_step_of_the_asked_shape(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(MODELS / "qwen3-tiny"), "--device", "cpu", "--decodes", "4", "--context", "40",
            "--prefill", "30", "--repeats", "2", "--max-num-batched-tokens", "256", "--max-model-len", "512"]
    assert _script().main(argv) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT ")][-1]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["batches_as_intended"] is True
    assert result["batches"] == [["decode", 0, 4], ["mixed", 30, 5]]  # 4 decodes; 30 prompt tokens + 5 sampled
    assert len(result["mixed_steps_ms"]) == len(result["decode_steps_ms"]) == 2


def test_the_mixed_bound_is_the_prefill_gemm_flops_at_the_online_shape() -> None:
    script = _script()
    args = script.parse_args(["--model", "m", "--decodes", "55", "--context", "1500", "--prefill", "1200"])
    config = json.loads((MODELS / "llama-3.1-8b" / "config.json").read_text())
    decode_ms, mixed_ms = script.bounds_ms(args, config)
    # Decode reads the 8B weights and 55 x ~1,516 tokens of K/V: ~5.3 ms + ~3.6 ms at 3,039 GB/s.
    assert 8.5 < decode_ms < 9.5
    # 1,255 tokens through the 7.0B decoder weights at 700.7 TFLOP/s is ~25 ms; attention adds < 1 ms.
    assert 24.0 < mixed_ms < 27.0
    assert mixed_ms > decode_ms


def test_a_prefill_larger_than_the_token_budget_is_refused_naming_the_flags() -> None:
    with pytest.raises(SystemExit):
        _script().parse_args(["--model", "m", "--prefill", "8190", "--decodes", "55"])
