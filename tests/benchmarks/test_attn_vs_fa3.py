"""benchmarks/gpu/attn_vs_fa3.py's cases (its timing needs CUDA and vLLM's FA3; the cases do not)."""


import pytest
from script_loader import load_script


def _script():
    return load_script("gpu/attn_vs_fa3.py")


def test_the_cases_are_valid_paged_batches_at_the_online_shapes() -> None:
    cases = {case.name: case for case in _script().online_cases()}
    for case in cases.values():
        assert len(case.query_lens) == len(case.seq_lens)
        assert all(0 < q <= s <= 4096 for q, s in zip(case.query_lens, case.seq_lens))
    mixed = cases["mixed 70 decodes + 1,050-token prompt"]
    assert mixed.query_lens.count(1) == 70 and mixed.query_lens[-1] == mixed.seq_lens[-1] == 1050
    assert sum(cases["prefill 8 x 1,024"].query_lens) == 8192  # the online token budget
    assert [len(cases[f"decode {n}"].seq_lens) for n in (64, 96, 256)] == [64, 96, 256]


def test_list_needs_no_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert _script().main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and lines[0].startswith("decode 64: 64 sequences, 64 query tokens")
