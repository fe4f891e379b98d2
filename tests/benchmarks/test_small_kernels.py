"""benchmarks/gpu/small_kernels.py imports, lists its cases and prices their bytes without a GPU; its calls
run under Triton's interpreter (TRITON_INTERPRET=1 with triton importable); its timing needs CUDA."""

from __future__ import annotations

import os
from types import ModuleType

import pytest
import torch
from script_loader import load_script

from conveyor.kernels.triton_compat import HAS_TRITON


def _script() -> ModuleType:
    return load_script("gpu/small_kernels.py")


def test_the_cases_are_the_three_kernels_at_every_token_count() -> None:
    cases = _script().cases([1, 55])
    assert [(c.kernel, c.heads.model, c.tokens) for c in cases[:2]] == [("qk_norm_rope_", "qwen3-0.6b", 1),
                                                                       ("qk_norm_rope_", "qwen3-0.6b", 55)]
    assert {(c.kernel, c.heads.model) for c in cases} == {
        ("qk_norm_rope_", "qwen3-0.6b"), ("rotary_", "llama-3.1-8b"), ("store_kv", "qwen3-0.6b"),
        ("store_kv", "llama-3.1-8b")}


def test_bytes_moved_at_the_profiled_shapes() -> None:
    script = _script()
    # Qwen3-0.6B at batch 256: q and k [256, 24, 128] bf16 read and written (~3.1 MB), cos/sin, weights
    qk = script.Case("qk_norm_rope_", script.QWEN3_06B, 256)
    assert qk.bytes_moved() == 2 * 256 * 24 * 128 * 2 + 2 * 256 * 128 * 2 + 2 * 128 * 2
    rope = script.Case("rotary_", script.LLAMA_8B, 55)
    assert rope.bytes_moved() == 2 * 55 * 40 * 128 * 2 + 2 * 55 * 128 * 2
    kv = script.Case("store_kv", script.LLAMA_8B, 55)
    assert kv.bytes_moved() == 4 * 55 * 8 * 128 * 2 + 8 * 55


@pytest.mark.skipif(HAS_TRITON and torch.cuda.is_available(), reason="checks the message without CUDA")
def test_without_cuda_it_exits_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert _script().main(["--tokens", "1"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


def test_token_counts_below_one_are_refused() -> None:
    with pytest.raises(SystemExit):
        _script().parse_args(["--tokens", "0"])


@pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs Triton's interpreter: TRITON_INTERPRET=1")
@pytest.mark.parametrize("kernel", ["qk_norm_rope_", "rotary_", "store_kv"])
def test_interpreted_calls_run_on_valid_inputs(kernel: str) -> None:
    script = _script()
    case = next(c for c in script.cases([3]) if c.kernel == kernel)
    script.make_call(case, torch.device("cpu"))()  # the wrappers' shape/stride/dtype asserts hold
