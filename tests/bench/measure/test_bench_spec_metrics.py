"""Speculative decoding in a run's summary: vLLM's spec_decode counters reduced to acceptance numbers,
the `bench run` line, the report's section, and a study whose one parameter is the speculative config."""

from __future__ import annotations

import json
import pathlib

import pytest
from decide.test_study import STUDY, _fake_launcher  # tests/bench is on sys.path (conftest.py)

from conveyor.bench.decide.study import run_study, spec_from_mapping
from conveyor.bench.decide.run_fn import RunTemplate
from conveyor.bench.jsonvalue import Fields
from conveyor.bench.load.launch import ServerSpec, render_args, render_command
from conveyor.bench.measure.prom_text import Snapshot
from conveyor.bench.measure.server_metrics import ServerObservation, server_summary
from conveyor.bench.measure.server_summary import ServerSummary
from conveyor.bench.measure.spec_metrics import describe_spec_decode
from conveyor.bench.measure.summary import RunSummary, summary_from_json
from conveyor.bench.report.dashboard import ReportInputs, analyze, format_markdown, format_terminal, spec_rows


def spec_text(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> str:
    lines = [f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {drafts}',
             f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {draft_tokens}',
             f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}']
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}} {n}'
              for i, n in enumerate(per_pos)]
    return "\n".join(lines) + '\nvllm:num_requests_running{model_name="m"} 0\n'


def test_acceptance_rate_and_mean_accepted_length_are_run_deltas() -> None:
    before = Snapshot.from_text(spec_text(10, 30, 12, [6, 4, 2]))
    after = Snapshot.from_text(spec_text(110, 330, 162, [86, 54, 22]))
    s = server_summary(ServerObservation(before=before, after=after))
    assert (s["spec_decode_num_drafts"], s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]) == (
        100, 300, 150)
    assert s["spec_decode_acceptance_rate"] == pytest.approx(0.5)
    assert s["spec_decode_mean_accepted_length"] == pytest.approx(2.5)  # 1 + 150 / 100: the target's token too
    assert s["spec_decode_acceptance_rate_per_pos"] == pytest.approx([0.8, 0.5, 0.2])
    line = describe_spec_decode(ServerSummary.from_json(Fields.of(s, "server")))
    assert line is not None and "50.0% of 300 draft tokens" in line and "2.50" in line


def test_a_server_without_speculation_leaves_the_numbers_null() -> None:
    snap = Snapshot.from_text('vllm:num_requests_running{model_name="m"} 0\n')
    s = server_summary(ServerObservation(before=snap, after=snap))
    assert s["spec_decode_acceptance_rate"] is None and s["spec_decode_mean_accepted_length"] is None
    assert describe_spec_decode(ServerSummary.from_json(Fields.of(s, "server"))) is None


def test_a_speculative_config_table_is_passed_as_json() -> None:
    args = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    assert render_args(args) == ["--speculative-config", '{"method":"ngram","num_speculative_tokens":3}']
    argv = render_command(ServerSpec("ngram", "conveyor serve --port {port} {args}", args=args), 8000)
    assert json.loads(argv[-1]) == {"method": "ngram", "num_speculative_tokens": 3}


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
DRAFT = {"method": "draft_model", "model": "draft.gguf", "num_speculative_tokens": 3}
SPEC_STUDY = {**STUDY, "baseline": {"max_num_seqs": 8}, "price_per_gpu_hour": 3.5,
              "variants": [{"name": "ngram", "speculative_config": NGRAM}, {"name": "draft", "speculative_config": DRAFT}]}


def _fake_spec_runs(template: RunTemplate):
    """Speculation raises capacity (ngram most, on this copy-heavy fake traffic) and reports acceptance."""
    capacity, accepted = {"baseline": 2.2, "ngram": 10.0, "draft": 5.0}[template.label], {"ngram": 0.6, "draft": 0.3}

    def run(rate: float, repeat: int, run_dir: pathlib.Path, num_requests: int | None = None) -> RunSummary:
        server: dict = {"num_requests_waiting_max": 0.0}
        if template.label in accepted:
            server.update(spec_decode_num_drafts=100.0, spec_decode_num_draft_tokens=300.0,
                          spec_decode_acceptance_rate=accepted[template.label],
                          spec_decode_mean_accepted_length=1 + 3 * accepted[template.label])
        e2e = 500.0 / (1 - rate / capacity) if rate < capacity else 60_000.0
        summary = {"label": f"{template.label}@{rate}#{repeat}", "request_rate": rate, "duration": 10.0,
                   "num_prompts": int(10 * rate), "completed": int(10 * min(rate, capacity)),
                   "request_throughput": min(rate, capacity), "output_throughput": 40 * min(rate, capacity),
                   "p95_e2el_ms": e2e, "error_rate": 0.0, "server": server}
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return summary_from_json(summary, run_dir.name, "fake")
    return run


def test_a_study_of_speculation_off_ngram_and_draft_picks_the_cheapest_per_accepted_response(
        tmp_path: pathlib.Path) -> None:
    spec = spec_from_mapping(SPEC_STUDY, "t")
    assert [(v.name, v.changed) for v in spec.variants] == [
        ("baseline", None), ("ngram", "speculative_config"), ("draft", "speculative_config")]
    launched: list[ServerSpec] = []
    run_study(spec, tmp_path, _fake_launcher(launched), _fake_spec_runs, progress=lambda _: None)
    assert "speculative_config" not in launched[0].args and launched[1].args["speculative_config"] == NGRAM
    analysis = analyze(ReportInputs((tmp_path,)))
    assert analysis.recommendation.recommended == "ngram"
    costs = {c.name: c.cost_per_accepted for c in analysis.configs}
    assert costs["ngram"] < costs["draft"] < costs["baseline"]
    rows = spec_rows(analysis)
    assert {row[0] for row in rows} == {"ngram", "draft"} and ["60%", "2.80"] in [row[3:5] for row in rows]
    assert "Speculative decoding (per run):" in format_terminal(analysis)
    assert "| Config | Run | Output tok/s | Draft acceptance |" in format_markdown(analysis)
