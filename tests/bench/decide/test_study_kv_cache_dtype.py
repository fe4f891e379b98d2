"""A study whose one parameter is --kv-cache-dtype (issue #37): the variant is a legal one-parameter
change, its server gets `--kv-cache-dtype fp8`, it varies none of the fixed things, and the report shows
which configuration ran bf16 and which fp8 (from each run's recorded server flags)."""

from __future__ import annotations

import json
import pathlib

from test_study import _fake_launcher

from conveyor.bench.decide.run_fn import RunTemplate
from conveyor.bench.decide.study import run_study, spec_from_mapping
from conveyor.bench.load.launch import ServerSpec, render_args
from conveyor.bench.measure.fixed import kv_cache_dtype
from conveyor.bench.measure.summary import RunSummary, summary_from_json
from conveyor.bench.report.dashboard import (
    ReportInputs,
    analyze,
    config_rows,
    format_terminal,
)

STUDY = {
    "command": "conveyor serve --device cuda --port {port} {args}", "trace": "t.jsonl", "main_rate": 1.0,
    "slo": {"e2e_p95_ms": 1000},
    "baseline": {"max_num_seqs": 256},
    "variants": [{"name": "kv-fp8", "kv_cache_dtype": "fp8"}],
    "sweep": {"rates": [1.0, 2.0, 4.0], "num_repeats": 1},
}


def _runs(template: RunTemplate):
    """fp8 holds twice the blocks: more capacity. Each run records its server's flags as a real run does
    (conveyor:config_info's labels: `kv_cache_dtype` auto or fp8, the model's dtype beside them)."""
    capacity, flag = {"baseline": (3.0, "auto"), "kv-fp8": (6.0, "fp8")}[template.label]

    def run(rate: float, repeat: int, run_dir: pathlib.Path, num_requests: int | None = None) -> RunSummary:
        e2e = 500.0 / (1 - rate / capacity) if rate < capacity else 60_000.0
        summary = {"label": f"{template.label}@{rate}#{repeat}", "request_rate": rate, "duration": 10.0,
                   "num_prompts": int(10 * rate), "completed": int(10 * min(rate, capacity)),
                   "request_throughput": min(rate, capacity), "p95_e2el_ms": e2e, "error_rate": 0.0,
                   "fixed": {"server_name": "conveyor", "dtype": "bfloat16", "gpu_name": "NVIDIA H100",
                             "server_flags": {"kv_cache_dtype": flag, "max_num_seqs": "256"}}}
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return summary_from_json(summary, run_dir.name, "fake")
    return run


def test_kv_cache_dtype_is_a_one_parameter_variant() -> None:
    spec = spec_from_mapping(STUDY, "t")
    variant = spec.variants[1]
    assert (variant.changed, variant.args) == ("kv_cache_dtype", {"max_num_seqs": 256, "kv_cache_dtype": "fp8"})
    assert variant.varied_fixed_keys() == []  # the model, its dtype, the GPU and the trace stay fixed
    assert render_args(variant.args) == ["--max-num-seqs", "256", "--kv-cache-dtype", "fp8"]


def test_recorded_kv_cache_dtype_resolves_auto_to_the_models_dtype() -> None:
    assert kv_cache_dtype({"dtype": "bfloat16", "server_flags": {"kv_cache_dtype": "auto"}}) == "bfloat16"
    assert kv_cache_dtype({"dtype": "bfloat16", "server_flags": {"kv_cache_dtype": "fp8"}}) == "fp8"
    assert kv_cache_dtype({"server_flags": {"cache_dtype": "fp8_e4m3"}}) == "fp8_e4m3"  # vLLM's label
    assert kv_cache_dtype({"server_flags": {}}) is None and kv_cache_dtype({}) is None


def test_report_shows_bf16_against_fp8(tmp_path: pathlib.Path) -> None:
    launched: list[ServerSpec] = []
    run_study(spec_from_mapping(STUDY, "t"), tmp_path, _fake_launcher(launched), _runs, progress=lambda _: None)
    assert launched[1].args["kv_cache_dtype"] == "fp8"
    analysis = analyze(ReportInputs((tmp_path,)))
    assert not analysis.fixed_differences  # the KV dtype is varied on purpose, not a mixed comparison
    assert [row[:2] for row in config_rows(analysis)] == [["baseline", "-"], ["kv-fp8", "kv_cache_dtype=fp8"]]
    text = format_terminal(analysis)
    assert "KV cache dtype per configuration: baseline=bfloat16, kv-fp8=fp8" in text
    assert analysis.recommendation.recommended == "kv-fp8"
