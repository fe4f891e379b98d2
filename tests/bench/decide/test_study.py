"""Study orchestration (file/flags -> configurations -> launch + sweep) with fake launch and runs."""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import random
from collections.abc import Iterator

import pytest

from conveyor.bench.cli import study as cli_study
from conveyor.bench.decide.run_fn import RunTemplate
from conveyor.bench.decide.study import StudyError, run_study, spec_from_mapping
from conveyor.bench.load.launch import LaunchError, ServerSpec
from conveyor.bench.measure.summary import RunSummary, summary_from_json
from conveyor.bench.report.dashboard import ReportInputs, analyze, decision_lines

STUDY = {
    "command": "conveyor serve --port {port} {args}", "trace": "t.jsonl", "main_rate": 1.0,
    "slo": {"e2e_p95_ms": 1000},
    "baseline": {"max_num_seqs": 8, "batching": "continuous"},
    "variants": [{"name": "static", "batching": "static"}, {"name": "seqs2", "max_num_seqs": 2}],
    "sweep": {"rates": [1.0, 2.0, 4.0], "num_repeats": 2},
}


def _fake_launcher(launched: list[ServerSpec]):
    @contextlib.contextmanager
    def launch(spec: ServerSpec, out_dir: pathlib.Path) -> Iterator[str]:
        launched.append(spec)
        out_dir.mkdir(parents=True, exist_ok=True)
        yield f"http://fake/{spec.name}"
    return launch


def _fake_runs(template: RunTemplate, noisy: bool = False):
    """Capacity per configuration ("twin" has the baseline's: a tie); with `noisy`, latency noise seeded by the
    run alone, so that nothing but the decision itself could depend on the order the runs were made in."""
    capacity = {"baseline": 8.0, "static": 3.0, "seqs2": 1.5, "twin": 8.0}[template.label]

    def run(rate: float, repeat: int, run_dir: pathlib.Path, num_requests: int | None = None) -> RunSummary:
        noise = random.Random(f"{template.label}/{rate}/{repeat}").uniform(0.95, 1.05) if noisy else 1.0
        e2e = noise * 500.0 / (1 - rate / capacity) if rate < capacity else 60_000.0
        summary = {"label": f"{template.label}@{rate}#{repeat}", "request_rate": rate, "duration": 10.0,
                   "num_prompts": int(10 * rate), "completed": int(10 * min(rate, capacity)),
                   "request_throughput": min(rate, capacity), "p95_e2el_ms": e2e, "error_rate": 0.0,
                   "server": {"num_requests_waiting_max": max(0.0, 10 * (rate - capacity))}}
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return summary_from_json(summary, run_dir.name, "fake")
    return run


def test_variants_change_one_parameter() -> None:
    spec = spec_from_mapping(STUDY, "t")
    assert [(v.name, v.changed) for v in spec.variants] == [("baseline", None), ("static", "batching"),
                                                            ("seqs2", "max_num_seqs")]
    assert spec.variants[1].args == {"max_num_seqs": 8, "batching": "static"}
    with pytest.raises(StudyError, match="exactly one parameter"):
        spec_from_mapping({**STUDY, "variants": [{"name": "x", "max_num_seqs": 4, "batching": "static"}]}, "t")
    with pytest.raises(StudyError, match="baseline's own value"):
        spec_from_mapping({**STUDY, "variants": [{"name": "x", "max_num_seqs": 8}]}, "t")
    with pytest.raises(StudyError, match="missing 'trace'"):
        spec_from_mapping({"command": "x"}, "t")


def test_study_runs_every_configuration(tmp_path: pathlib.Path) -> None:
    launched: list[ServerSpec] = []
    run_study(spec_from_mapping(STUDY, "t"), tmp_path, _fake_launcher(launched), _fake_runs, progress=lambda _: None)
    assert [s.name for s in launched] == ["baseline", "static", "seqs2"]
    assert launched[1].args["batching"] == "static"
    record = json.loads((tmp_path / "study.json").read_text())
    assert record["configs"]["baseline"]["max_rate_meeting"] == 4.0
    assert record["configs"]["static"]["max_rate_meeting"] == 1.0
    # seqs2 misses at 1 and 2 req/s; at 4, 25 of 40 requests wait at once (runaway): one repeat, stop.
    assert (tmp_path / "seqs2" / "rate-4-rep0").exists() and not (tmp_path / "seqs2" / "rate-4-rep1").exists()
    assert record["configs"]["seqs2"]["max_rate_meeting"] is None
    analysis = analyze(ReportInputs((tmp_path,)))
    assert analysis.recommendation.recommended == "baseline"


def test_flags_override_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "study.toml"
    path.write_text('command = "vllm serve m --port {port} {args}"\ntrace = "a.jsonl"\n[slo]\nttft_p95_ms = 100\n')
    parser = argparse.ArgumentParser()
    cli_study.add_arguments(parser)
    args = parser.parse_args([str(path), "--trace", "b.jsonl", "--baseline", "max_num_seqs=4",
                              "--variant", "nochunk:enable_chunked_prefill=false", "--rates", "1,2",
                              "--repeats", "1", "--num-requests", "20"])
    spec = spec_from_mapping(cli_study.study_mapping(args), "t")
    assert spec.trace_path == "b.jsonl" and spec.command.startswith("vllm serve")
    assert spec.variants[1].args == {"max_num_seqs": 4, "enable_chunked_prefill": False}
    assert spec.rates == (1.0, 2.0) and spec.sweep.num_repeats == 1
    assert spec.run_options == {"num_requests": 20, "show_progress": False} and spec.slo.ttft_p95_ms == 100


def test_study_flags_survive_the_top_level_dispatcher(tmp_path: pathlib.Path) -> None:
    """`--command` must not clobber conveyor's own `command` attribute (the chosen subcommand)."""
    from conveyor.cli import build_parser

    argv = ["bench", "study", "--command", "x --port {port}", "--trace", "t.jsonl", "--out", str(tmp_path)]
    args = build_parser("bench").parse_args(argv)
    assert args.conveyor_subcommand == "bench" and args.bench_command == "study"
    assert cli_study.study_mapping(args)["command"] == "x --port {port}"


def _noisy_runs(template: RunTemplate):
    return _fake_runs(template, noisy=True)


def test_the_recommendation_is_the_same_with_the_configurations_run_in_reverse_order(tmp_path: pathlib.Path) -> None:
    """Issue 33 item 7, the decision half: the same study run first to last and last to first recommends the
    same configuration with the same confidence -- a tie included, which goes to the baseline either way."""
    study = {**STUDY, "variants": [*STUDY["variants"], {"name": "twin", "max_num_seqs": 16}]}  # type: ignore[misc]
    spec = spec_from_mapping(study, "t")
    answers = []
    for reverse in (False, True):
        launched: list[ServerSpec] = []
        out = tmp_path / ("reverse" if reverse else "forward")
        run_study(spec, out, _fake_launcher(launched), _noisy_runs, progress=lambda _: None, reverse_order=reverse)
        assert [s.name for s in launched][0] == ("twin" if reverse else "baseline")
        analysis = analyze(ReportInputs((out,)))
        assert [c.name for c in analysis.configs] == ["baseline", "static", "seqs2", "twin"]  # study order kept
        answers.append((analysis.headline, analysis.recommendation.outcome, analysis.recommendation.tied,
                        [i.answer for i in analysis.checklist]))
    assert answers[0] == answers[1]
    assert answers[0][1].value == "tie" and answers[0][0].startswith("baseline (tied with twin)")


def test_a_configuration_that_cannot_start_is_recorded_and_the_study_goes_on(tmp_path: pathlib.Path) -> None:
    launched: list[ServerSpec] = []
    fake = _fake_launcher(launched)

    @contextlib.contextmanager
    def launch(spec: ServerSpec, out_dir: pathlib.Path) -> Iterator[str]:
        if spec.name == "static":
            raise LaunchError("server static exited with 1 before becoming healthy; log tail:\nloading\n"
                              "conveyor serve: error: no GPU memory left for the KV cache")
        with fake(spec, out_dir) as url:
            yield url

    run_study(spec_from_mapping(STUDY, "t"), tmp_path, launch, _fake_runs, progress=lambda _: None)
    record = json.loads((tmp_path / "study.json").read_text())
    assert [s.name for s in launched] == ["baseline", "seqs2"]
    assert record["configs"]["static"]["launch_error"] == "conveyor serve: error: no GPU memory left for the KV cache"
    assert "max_rate_meeting" not in record["configs"]["static"]
    assert record["configs"]["seqs2"]["max_rate_meeting"] is None
    shown = decision_lines(analyze(ReportInputs((tmp_path,))))
    assert "Did not start: static: conveyor serve: error: no GPU memory left for the KV cache" in shown


def test_a_study_stopped_midway_keeps_its_configurations(tmp_path: pathlib.Path) -> None:
    """sweep.json is written after every point, and runs under a study's configuration directory that
    has none (a study killed before its first point ended) still belong to that configuration."""
    launched: list[ServerSpec] = []
    run_study(spec_from_mapping(STUDY, "t"), tmp_path, _fake_launcher(launched), _fake_runs, progress=lambda _: None)
    (tmp_path / "static" / "sweep.json").unlink()
    analysis = analyze(ReportInputs((tmp_path,)))
    assert [c.name for c in analysis.configs] == ["baseline", "static", "seqs2"]
    assert (tmp_path / "seqs2" / "sweep.json").is_file()
