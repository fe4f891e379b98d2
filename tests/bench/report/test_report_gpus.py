"""One decision across machines: studies from two GPUs merged into one report (issue 35 item 3).

The synthetic studies reuse the study_ab fixture: on the "H200" the baseline is its `continuous`
configuration (capacity [4, 8) req/s), on the "H100" its `static` one ([2, 4) req/s), each run's
summary.json recording the GPU in `fixed.gpu_name` as a real run does.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil

import pytest

from conveyor.bench.cli import report as cli_report
from conveyor.bench.decide.gpu_prices import PriceMatchError
from conveyor.bench.decide.slo import SLO
from conveyor.bench.measure.gpu_groups import MixedGpuError
from conveyor.bench.report.dashboard import (
    MixedRunsError,
    ReportInputs,
    analyze,
    format_markdown,
    format_terminal,
)
from conveyor.bench.report.write import write_report

FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "study_ab"
H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"


def _set_gpu(config_dir: pathlib.Path, gpu: str, only: str = "") -> None:
    for path in config_dir.glob(f"{only or '*'}/summary.json"):
        summary = json.loads(path.read_text())
        summary["fixed"] = {"gpu_name": gpu, "gpu_count": 1, "model_path": "/models/llama"}
        summary.setdefault("server", {})["peak_gpu_memory_bytes"] = 60 * 2**30 if "H100" in gpu else 90 * 2**30
        path.write_text(json.dumps(summary))


def _study(root: pathlib.Path, gpu: str, source: str, price: float | None = None,
           names: tuple[str, ...] = ("baseline",)) -> pathlib.Path:
    """A study of configurations `names` (each a copy of the fixture's `source`), measured on `gpu`."""
    for name in names:
        shutil.copytree(FIXTURE / source, root / name)
        _set_gpu(root / name, gpu)
    config = {} if price is None else {"price_per_gpu_hour": price}
    study = {"slo": {"ttft_p95_ms": 500.0, "e2e_p95_ms": 4000.0, "error_rate": 0.01}, "main_rate": 2.0,
             "configs": {name: config for name in names}}
    (root / "study.json").write_text(json.dumps(study))
    return root


@pytest.fixture
def studies(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    return _study(tmp_path / "h100", H100, "static"), _study(tmp_path / "h200", H200, "continuous")


def test_a_configuration_is_gpu_and_name_never_pooled(studies: tuple[pathlib.Path, pathlib.Path]) -> None:
    analysis = analyze(ReportInputs(studies, gpu_prices={"H100": 1.0, "H200": 5.0}))
    assert [c.name for c in analysis.configs] == ["baseline on H100", "baseline on H200"]
    assert [len(c.points) for c in analysis.configs] == [3, 4]  # each GPU's own rates, nothing pooled
    assert analysis.gpus.gpu_names == (H100, H200) and not analysis.fixed_differences  # the GPU differs on purpose
    assert {c.name: c.capacity.describe() for c in analysis.configs} == {
        "baseline on H100": "[2, 4) req/s", "baseline on H200": "[4, 8) req/s"}


def test_the_cheaper_per_accepted_gpu_wins_though_the_other_has_more_capacity(
        studies: tuple[pathlib.Path, pathlib.Path]) -> None:
    analysis = analyze(ReportInputs(studies, gpu_prices={"H100": 1.0, "h200": 5.0}))
    by_name = {c.name: c for c in analysis.configs}
    h100, h200 = by_name["baseline on H100"].cost_per_accepted, by_name["baseline on H200"].cost_per_accepted
    assert h100 is not None and h200 is not None and h100 < h200
    assert analysis.recommendation.recommended == "baseline on H100" and analysis.recommendation.priced
    assert analysis.headline.startswith("baseline on H100: capacity [2, 4) req/s, cost $")
    assert "--price H100" in analysis.headline and analysis.checklist[0].answer.value == "yes"
    # the checklist answers from the H100's own runs
    assert "baseline on H100" in analysis.checklist[0].evidence


def test_prices_flip_the_answer(studies: tuple[pathlib.Path, pathlib.Path]) -> None:
    analysis = analyze(ReportInputs(studies, gpu_prices={"H100": 3.0, "H200": 2.0}))
    assert analysis.recommendation.recommended == "baseline on H200"


def test_an_unpriced_gpu_ranks_by_capacity_per_gpu_and_says_so(studies: tuple[pathlib.Path, pathlib.Path]) -> None:
    analysis = analyze(ReportInputs(studies, gpu_prices={"H200": 5.0}))
    assert not analysis.recommendation.priced
    assert analysis.recommendation.recommended == "baseline on H200"  # more capacity per GPU, though dearer
    text = format_terminal(analysis)
    assert "no price given for H100" in text and "$5/GPU-hour from --price H200" in text
    assert "ranked by capacity per GPU" in analysis.recommendation.reasons[0]


def test_each_study_keeps_its_own_price(tmp_path: pathlib.Path) -> None:
    h100 = _study(tmp_path / "h100", H100, "static", price=1.0)
    h200 = _study(tmp_path / "h200", H200, "continuous", price=5.0)
    analysis = analyze(ReportInputs((h100, h200)))
    models = {c.name: c.cost.model for c in analysis.configs if c.cost is not None}
    assert models["baseline on H100"].price_per_gpu_hour == 1.0 and models["baseline on H200"].price_per_gpu_hour == 5.0
    assert analysis.recommendation.recommended == "baseline on H100"
    flagged = analyze(ReportInputs((h100, h200), gpu_prices={"H100": 9.0}))  # the flag names the GPU: it wins
    assert {c.name: c.cost.model.price_source for c in flagged.configs if c.cost is not None} == {
        "baseline on H100": "--price H100", "baseline on H200": "study.json"}


def test_price_keys_that_match_no_gpu_or_several_are_errors(studies: tuple[pathlib.Path, pathlib.Path]) -> None:
    with pytest.raises(PriceMatchError, match="--price B200: matches no GPU"):
        analyze(ReportInputs(studies, gpu_prices={"H100": 1.0, "B200": 5.0}))
    with pytest.raises(PriceMatchError, match="--price NVIDIA: ambiguous"):
        analyze(ReportInputs(studies, gpu_prices={"NVIDIA": 1.0}))


def test_one_sweep_holding_two_gpus_is_refused_unless_allow_mixed(tmp_path: pathlib.Path) -> None:
    study = _study(tmp_path / "mixed", H100, "continuous")
    _set_gpu(study / "baseline", H200, only="rate-8-*")
    with pytest.raises(MixedGpuError, match=r"baseline mixes GPUs: NVIDIA H100 80GB HBM3 .*; NVIDIA H200"):
        analyze(ReportInputs((study,)))
    split = analyze(ReportInputs((study,), allow_mixed=True))
    assert [c.name for c in split.configs] == ["baseline on H100", "baseline on H200"]
    assert any("split into one configuration per GPU" in line for line in format_terminal(split).splitlines())


def test_one_gpu_reads_as_before(tmp_path: pathlib.Path) -> None:
    """Runs of one GPU keep their plain names; --price then prices that GPU."""
    analysis = analyze(ReportInputs((_study(tmp_path / "h100", H100, "static"),), gpu_prices={"h100": 2.0}))
    assert [c.name for c in analysis.configs] == ["baseline"]
    cost = analysis.configs[0].cost
    assert cost is not None and cost.model.price_source == "--price h100"


def test_per_gpu_dashboard_in_console_markdown_and_html(studies: tuple[pathlib.Path, pathlib.Path],
                                                        tmp_path: pathlib.Path) -> None:
    analysis = analyze(ReportInputs(studies, gpu_prices={"H100": 1.0, "H200": 5.0}))
    text = format_terminal(analysis)
    assert "Per GPU (valid runs):" in text and f"GPU H100 ({H100}): $1/GPU-hour from --price H100" in text
    row = next(line for line in text.splitlines() if line.startswith("H200  "))
    assert "baseline on H200" in row and "90 GiB" in row and "40%" in row  # peak memory, KV usage peak
    assert "Per GPU" in format_markdown(analysis)
    page = write_report(analysis, tmp_path / "report")["html"].read_text()
    assert 'id="gpus"' in page and "baseline on H100" in page


def test_cli_price_flag_and_its_errors(studies: tuple[pathlib.Path, pathlib.Path],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    cli_report.add_arguments(parser)
    paths = [str(p) for p in studies]
    assert cli_report.run(parser.parse_args([*paths, "--price", "H100=1,H200=5", "--no-html"])) == 0
    assert "Recommendation: baseline on H100" in capsys.readouterr().out
    assert cli_report.run(parser.parse_args([*paths, "--price", "H100=1", "--price", "A100=2", "--no-html"])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("conveyor report: --price A100: matches no GPU") and "\n" not in err
    assert cli_report.run(parser.parse_args([*paths, "--price", "H100", "--no-html"])) == 2
    assert "--price: expected GPU=USD_PER_HOUR" in capsys.readouterr().err


def test_the_host_gpu_count_may_differ_across_gpus_but_not_within_one(tmp_path: pathlib.Path) -> None:
    h100 = _study(tmp_path / "h100", H100, "static")
    h200 = _study(tmp_path / "h200", H200, "continuous")
    for path in (h200 / "baseline").glob("*/summary.json"):  # an 8-GPU host shows 8
        summary = json.loads(path.read_text())
        summary["fixed"]["gpu_count"] = 8
        path.write_text(json.dumps(summary))
    assert not analyze(ReportInputs((h100, h200))).fixed_differences
    second = _study(tmp_path / "h100b", H100, "static")
    (second / "baseline").rename(second / "other")
    (second / "study.json").write_text((second / "study.json").read_text().replace("baseline", "other"))
    for path in (second / "other").glob("*/summary.json"):
        summary = json.loads(path.read_text())
        summary["fixed"]["gpu_count"] = 2
        path.write_text(json.dumps(summary))
    with pytest.raises(MixedRunsError, match="gpu_count differs: 1 .*; 2 "):
        analyze(ReportInputs((h100, h200, second)))


def test_studies_with_different_objectives_need_one_given(studies: tuple[pathlib.Path, pathlib.Path]) -> None:
    path = studies[1] / "study.json"
    path.write_text(path.read_text().replace('"ttft_p95_ms": 500.0', '"ttft_p95_ms": 900.0'))
    with pytest.raises(MixedGpuError, match="objectives differ.*pass --slo"):
        analyze(ReportInputs(studies))
    given = analyze(ReportInputs(studies, slo=SLO(ttft_p95_ms=500.0, e2e_p95_ms=4000.0, error_rate=0.01)))
    assert len(given.configs) == 2


def test_runs_without_a_gpu_name_are_kept_apart(studies: tuple[pathlib.Path, pathlib.Path],
                                                tmp_path: pathlib.Path) -> None:
    loose = tmp_path / "loose"
    shutil.copytree(FIXTURE / "static" / "rate-1-rep0", loose / "rate-1-rep0")
    analysis = analyze(ReportInputs((*studies, loose)))
    assert [c.name for c in analysis.configs] == ["baseline on H100", "baseline on H200", "static@1#0 on unknown GPU"]
    assert "some runs recorded no fixed.gpu_name" in format_terminal(analysis)


def test_order_is_gpu_then_study_then_the_studys_own(tmp_path: pathlib.Path) -> None:
    """Ties go to the earlier configuration: the first GPU given, its first study, that study's baseline."""
    given = (_study(tmp_path / "a100", H100, "static", names=("zeta", "alpha")),
             _study(tmp_path / "b100", H100, "static", names=("beta",)),
             _study(tmp_path / "a200", H200, "static", names=("gamma",)))
    analysis = analyze(ReportInputs(given))
    assert [c.name for c in analysis.configs] == ["zeta on H100", "alpha on H100", "beta on H100", "gamma on H200"]
    assert analysis.recommendation.recommended == "zeta on H100"  # all tie (no price): the first one
