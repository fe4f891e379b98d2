"""Diagnosis of a disappointing result: the guide's five symptoms, each finding citing its numbers.

The model: each rule reads the run summaries (and, where present, the server time series, the
per-request records and the server's config_info) and fires at most once per configuration, on the run
that shows the symptom most strongly, with the values that triggered it and the guide's remedy:
  1. waiting grows while KV usage stays low   -> admission limit, low max_num_seqs, tokenization, client
  2. TTFT grows for long prompts               -> chunked prefill and token budget (long class vs others)
  3. throughput improves but p95 worsens       -> over-admission (compares configurations at one rate)
  4. preemptions or out-of-memory rise         -> KV capacity
  5. low utilisation while requests wait       -> CPU, tokenization, network, client pacing
     (inputs: GPU utilisation, from NVML or conveyor:gpu_utilization_perc; CPU tokenization time,
     conveyor:tokenization_time_seconds; the client's own CPU; running vs max_num_seqs and KV usage)
Invalid runs (validity.py) are skipped: they measured the client, not the server. Thresholds live in
`DiagnoseThresholds`; a healthy run (little waiting, balanced classes, no preemption, client on time)
triggers nothing.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from conveyor.bench.jsonvalue import Fields
from conveyor.bench.measure.rundirs import Point, RunResult


class Symptom(enum.Enum):
    WAITING_WITH_FREE_KV = "waiting_with_free_kv"
    LONG_PROMPT_TTFT = "long_prompt_ttft"
    THROUGHPUT_UP_P95_WORSE = "throughput_up_p95_worse"
    PREEMPTIONS_OR_OOM = "preemptions_or_oom"
    IDLE_WHILE_WAITING = "idle_while_waiting"


@dataclass(frozen=True)
class DiagnoseThresholds:
    """When each rule fires."""

    min_waiting: float = 4.0
    """Peak waiting requests that count as a queue."""
    low_kv_usage: float = 0.5
    """KV usage peak under which memory is not the constraint."""
    long_ttft_ratio: float = 3.0
    """Long-class p95 TTFT over the other classes' worst p95 TTFT."""
    min_long_ttft_ms: float = 50.0
    """Ignore the long-class ratio below this absolute p95 TTFT."""
    throughput_gain: float = 0.05
    """Relative throughput gain of one configuration over another..."""
    p95_loss: float = 0.2
    """...while its p95 E2E or TTFT is this much worse."""
    saturated_fraction: float = 0.9
    """Rule 3 compares at rates where the other configuration completes less than this share of the offered."""
    preemptions_per_request: float = 0.01
    """Preemptions per completed request that count as rising."""
    low_running_fraction: float = 0.5
    """Running peak under this fraction of max_num_seqs while requests wait: the engine is starved."""
    low_gpu_utilization: float = 0.5
    """GPU utilisation (if recorded) under which the device idles."""
    tokenization_share: float = 0.25
    """Mean CPU tokenization time over median TTFT above which tokenization delays first tokens..."""
    min_tokenization_ms: float = 10.0
    """...when it also takes at least this long per request."""
    busy_client_cpu: float = 0.7
    """Client CPU (cores) above which the load generator is close to its limit (invalid at 0.9)."""


@dataclass(frozen=True)
class Finding:
    """One symptom found, with evidence and remedy."""

    symptom: Symptom
    """Which of the five."""
    config_name: str
    """Configuration it was seen in."""
    run_label: str
    """The run that shows it most strongly."""
    evidence: str
    """The numbers that triggered it."""
    remedy: str
    """What the guide says to look at."""


def _waiting_trend(run: RunResult) -> tuple[float, float] | None:
    """Mean waiting in the first and last third of the time series (None if too short)."""
    series = [s.num_requests_waiting or 0.0 for s in run.timeseries()]
    if len(series) < 6:
        return None
    third = len(series) // 3
    return sum(series[:third]) / third, sum(series[-third:]) / third


def _max_num_seqs(run: RunResult) -> float | None:
    value = Fields(run.config_info(), "server.json: config_info").opt_text("max_num_seqs")
    return None if value is None else float(value)


def waiting_with_free_kv(runs: list[RunResult], th: DiagnoseThresholds) -> Finding | None:
    hits = [r for r in runs if (r.metric("num_requests_waiting_max") or 0) >= th.min_waiting
            and r.metric("kv_cache_usage_max") is not None
            and (r.metric("kv_cache_usage_max") or 0) <= th.low_kv_usage]
    if not hits:
        return None
    run = min(hits, key=lambda r: r.offered_rate)
    running, cap = run.metric("num_requests_running_max"), _max_num_seqs(run)
    evidence = (f"at {run.offered_rate:.3g} req/s waiting peaks at {run.metric('num_requests_waiting_max'):.0f} "
                f"while KV usage peaks at {run.metric('kv_cache_usage_max'):.0%}")
    trend = _waiting_trend(run)
    if trend is not None:
        evidence += f"; waiting mean {trend[0]:.1f} in the first third -> {trend[1]:.1f} in the last"
    if running is not None:
        evidence += f"; running peak {running:.0f}" + (f" = max_num_seqs {cap:.0f}" if cap == running else "")
    memory = run.metric("peak_gpu_memory_bytes")
    evidence += (f"; GPU memory peak {memory / 2**30:.3g} GiB" if memory is not None else
                 "; GPU memory peak not reported (conveyor:gpu_memory_peak_bytes or NVML)")
    remedy = ("memory is not the limit: check admission limits and max_num_seqs (raise it if running sits at "
              "the cap), CPU tokenization and the client's concurrency")
    return Finding(Symptom.WAITING_WITH_FREE_KV, run.config_name, run.label, evidence, remedy)


def _long_class(run: RunResult) -> str | None:
    classes = list(run.summary.per_class)
    named = [c for c in classes if "long" in c.lower()]
    return named[0] if named else None


def _long_ratio(run: RunResult) -> tuple[float, str, float, float] | None:
    long_name = _long_class(run)
    per_class = run.summary.per_class
    if long_name is None or len(per_class) < 2:
        return None
    long_p95 = per_class[long_name].value("p95_ttft_ms")
    others = [v.value("p95_ttft_ms") for k, v in per_class.items() if k != long_name]
    others_worst = max((o for o in others if o is not None), default=None)
    if long_p95 is None or not others_worst:
        return None
    return long_p95 / others_worst, long_name, long_p95, others_worst


def long_prompt_ttft(runs: list[RunResult], th: DiagnoseThresholds) -> Finding | None:
    scored = [(found, r) for r in runs if (found := _long_ratio(r)) is not None
              and found[0] >= th.long_ttft_ratio and found[2] >= th.min_long_ttft_ms]
    if not scored:
        return None
    (ratio, name, long_p95, others), run = max(scored, key=lambda s: s[0][0])
    evidence = (f"at {run.offered_rate:.3g} req/s the {name!r} class has p95 TTFT {long_p95:.0f} ms, "
                f"{ratio:.1f}x the other classes' worst ({others:.0f} ms)")
    remedy = ("enable chunked prefill / tune max_num_batched_tokens and long_prefill_token_threshold; "
              "compare the long class's distribution, not only the mean")
    return Finding(Symptom.LONG_PROMPT_TTFT, run.config_name, run.label, evidence, remedy)


def throughput_up_p95_worse(points: dict[str, list[Point]], th: DiagnoseThresholds) -> list[Finding]:
    """Configuration B vs A at the same offered rate: more completed req/s, worse p95."""
    findings: dict[str, Finding] = {}
    for name_b, points_b in points.items():
        for name_a, points_a in points.items():
            if name_a == name_b or name_b in findings:
                continue
            by_rate_a = {p.offered_rate: p for p in points_a}
            for point_b in points_b:
                finding = _compare(by_rate_a.get(point_b.offered_rate), point_b, th)
                if finding is not None:
                    findings[name_b] = finding
                    break
    return list(findings.values())


def _compare(a: Point | None, b: Point, th: DiagnoseThresholds) -> Finding | None:
    if a is None:
        return None
    thr_a, thr_b = a.median("request_throughput"), b.median("request_throughput")
    if not thr_a or not thr_b or thr_b < thr_a * (1 + th.throughput_gain):
        return None
    if math.isfinite(a.offered_rate) and thr_a >= th.saturated_fraction * a.offered_rate:
        return None  # A keeps up with the offered load: a throughput "gain" there is sampling noise
    for metric in ("p95_e2el_ms", "p95_ttft_ms"):
        lat_a, lat_b = a.median(metric), b.median(metric)
        if lat_a and lat_b and lat_b >= lat_a * (1 + th.p95_loss):
            evidence = (f"at {b.offered_rate:.3g} req/s {b.config_name} completes {thr_b:.3g} req/s vs "
                        f"{a.config_name}'s {thr_a:.3g} (+{thr_b / thr_a - 1:.0%}) but {metric} is "
                        f"{lat_b:.0f} vs {lat_a:.0f} ms (+{lat_b / lat_a - 1:.0%})")
            remedy = ("it admits more concurrent work than the interactive objective allows: limit admission "
                      "(max_num_seqs, --max-num-queued-reqs), use a queue timeout or a separate pool, "
                      "and re-test at the same offered rate")
            return Finding(Symptom.THROUGHPUT_UP_P95_WORSE, b.config_name, b.runs[0].label, evidence, remedy)
    return None


def _oom_errors(run: RunResult) -> int:
    return sum(1 for r in run.requests() if "out of memory" in (r.error_message or "").lower())


def preemptions_or_oom(runs: list[RunResult], th: DiagnoseThresholds) -> Finding | None:
    def rate_of(run: RunResult) -> float:
        completed = float(run.summary.completed) or 1.0
        return (run.metric("num_preemptions") or 0.0) / completed

    hits = [r for r in runs if rate_of(r) >= th.preemptions_per_request or _oom_errors(r) > 0]
    if not hits:
        return None
    run = max(hits, key=rate_of)
    by_rate = sorted({(r.offered_rate, r.metric("num_preemptions") or 0.0) for r in runs})
    trend = ", ".join(f"{rate:g}->{count:.0f}" for rate, count in by_rate[:6])
    evidence = (f"at {run.offered_rate:.3g} req/s {run.metric('num_preemptions') or 0:.0f} preemptions for "
                f"{run.summary.completed} completed ({rate_of(run):.2f}/request), KV peak "
                f"{run.metric('kv_cache_usage_max') or 0:.0%}, out-of-memory errors {_oom_errors(run)}; "
                f"preemptions by rate: {trend}")
    remedy = ("the active contexts do not fit the KV cache: lower max_num_seqs or max_model_len, pick a GPU "
              "with more memory (conveyor plan), or revisit model/precision; a preemption is not free")
    return Finding(Symptom.PREEMPTIONS_OR_OOM, run.config_name, run.label, evidence, remedy)


def _upstream_evidence(run: RunResult, waiting: float, th: DiagnoseThresholds) -> str | None:
    """CPU tokenization or a busy client while requests wait (the inputs diagnosis 5 names)."""
    tokenize, ttft = run.metric("tokenization_time_mean_ms"), run.metric("median_ttft_ms")
    if tokenize is not None and ttft and tokenize >= th.min_tokenization_ms and tokenize >= th.tokenization_share * ttft:
        return (f"CPU tokenization takes {tokenize:.0f} ms per request ({tokenize / ttft:.0%} of the median TTFT "
                f"{ttft:.0f} ms) while waiting peaks at {waiting:.0f}")
    cpu = run.metric("client_cpu_utilization")
    if cpu is not None and cpu >= th.busy_client_cpu:
        return (f"the benchmark client used {cpu:.0%} of a core while waiting peaks at {waiting:.0f}: the load "
                "generator is close to its limit")
    return None


def _idle_evidence(run: RunResult, th: DiagnoseThresholds) -> str | None:
    waiting = run.metric("num_requests_waiting_max") or 0.0
    if waiting < th.min_waiting:
        return None
    util = run.metric("gpu_utilization_mean")
    if util is not None and util < th.low_gpu_utilization:
        return f"GPU utilisation {util:.0%} while waiting peaks at {waiting:.0f}"
    upstream = _upstream_evidence(run, waiting, th)
    if upstream is not None:
        return upstream
    running, cap, kv = run.metric("num_requests_running_max"), _max_num_seqs(run), run.metric("kv_cache_usage_max")
    if running is not None and cap and kv is not None and running < th.low_running_fraction * cap \
            and kv <= th.low_kv_usage:
        return (f"waiting peaks at {waiting:.0f} while running peaks at {running:.0f} of max_num_seqs "
                f"{cap:.0f} and KV at {kv:.0%}: neither the cap nor memory holds requests back")
    return None


def idle_while_waiting(runs: list[RunResult], th: DiagnoseThresholds) -> Finding | None:
    for run in sorted(runs, key=lambda r: r.offered_rate):
        evidence = _idle_evidence(run, th)
        if evidence is not None:
            remedy = ("inspect CPU, tokenization, network, storage, model loading and the client's pacing "
                      "before blaming continuous batching")
            return Finding(Symptom.IDLE_WHILE_WAITING, run.config_name, run.label,
                           f"at {run.offered_rate:.3g} req/s {evidence}", remedy)
    return None


def _valid_only(point: Point) -> Point | None:
    """The point without its invalid runs (they measured the client); None when none is left."""
    runs = tuple(r for r in point.runs if r.valid)
    return Point(point.config_name, point.offered_rate, runs) if runs else None


def diagnose(points: dict[str, list[Point]], th: DiagnoseThresholds | None = None) -> list[Finding]:
    """Every finding on valid runs only, per configuration in order, then the cross-configuration one."""
    th = th or DiagnoseThresholds()
    points = {name: [valid for p in pts if (valid := _valid_only(p)) is not None] for name, pts in points.items()}
    findings: list[Finding] = []
    for config_points in points.values():
        runs = [r for p in config_points for r in p.runs]
        for rule in (waiting_with_free_kv, long_prompt_ttft, preemptions_or_oom, idle_while_waiting):
            finding = rule(runs, th)
            if finding is not None:
                findings.append(finding)
    findings.extend(throughput_up_p95_worse(points, th))
    return findings
