"""The dashboard per GPU: what each GPU's configurations went through, beside what they cost.

The model: for every (GPU, configuration), over its valid runs (invalid ones measured the client), the
guide's dashboard signals summed or at their worst -- preemptions (and per completed request), the KV
cache usage peak, the worst run's p95 queue time, failures (with their kinds), the peak GPU memory the
server reported ("not recorded" when it reported none) -- then the capacity and the one cost per accepted
response (decide/cost.py) at the GPU's price. The lines above the table say which price each GPU got, so
a GPU without one reads "no price given for H100", never a made-up number.
"""

from __future__ import annotations

from collections.abc import Mapping

from conveyor.bench.decide.decision import ConfigEval
from conveyor.bench.decide.gpu_prices import GpuPrice
from conveyor.bench.measure.gpu_groups import GpuConfigs
from conveyor.bench.measure.rundirs import RunResult
from conveyor.bench.report.report_format import summary_cell
from conveyor.bench.units import fmt_bytes, fmt_count, fmt_percent

GPU_COLUMNS = ("GPU", "Config", "Valid runs", "Preemptions", "KV usage peak", "Queue p95 (worst run)", "Failures",
               "Peak GPU memory", "Capacity (req/s)", "Cost per accepted response")
NOT_RECORDED = "not recorded"


def _peak(runs: list[RunResult], name: str) -> float | None:
    values = [v for v in (r.metric(name) for r in runs) if v is not None]
    return max(values) if values else None


def _preemptions(runs: list[RunResult]) -> str:
    counts = [v for v in (r.metric("num_preemptions") for r in runs) if v is not None]
    if not counts:
        return NOT_RECORDED
    completed = sum(r.summary.completed for r in runs)
    per = f" ({sum(counts) / completed:.2g} per completed)" if completed else ""
    return f"{fmt_count(sum(counts))}{per}"


def _failures(runs: list[RunResult]) -> str:
    failed, sent = sum(r.summary.failed for r in runs), sum(r.summary.num_prompts for r in runs)
    kinds: dict[str, int] = {}
    for run in runs:
        for kind, count in run.summary.errors_by_kind.items():
            kinds[kind] = kinds.get(kind, 0) + count
    shown = ", ".join(f"{kind} {count:,}" for kind, count in sorted(kinds.items()) if count)
    return f"{failed:,} of {sent:,}" + (f" ({shown})" if shown else "")


def _queue(runs: list[RunResult]) -> str:
    worst = max(runs, key=lambda r: r.metric("queue_time_p95_ms") or -1.0)
    return summary_cell(worst.summary, "server.queue_time_p95_ms")


def gpu_row(gpu: str, config: ConfigEval) -> list[str]:
    """One (GPU, configuration): its valid runs' dashboard signals, capacity and cost."""
    runs = [r for p in config.points for r in p.valid_runs]
    cost = config.cost.short() if config.cost is not None else "no operating point, so no cost"
    if not runs:
        return [gpu, config.name, "0", *(["-"] * 5), config.capacity.describe(), cost]
    kv, memory = _peak(runs, "kv_cache_usage_max"), _peak(runs, "peak_gpu_memory_bytes")
    return [gpu, config.name, str(len(runs)), _preemptions(runs), NOT_RECORDED if kv is None else fmt_percent(kv),
            _queue(runs), _failures(runs), NOT_RECORDED if memory is None else fmt_bytes(memory),
            config.capacity.describe(), cost]


def gpu_rows(configs: list[ConfigEval], gpus: GpuConfigs) -> list[list[str]]:
    """One row per (GPU, configuration), grouped by GPU in the order the runs were given."""
    rows = []
    for gpu_name in (*gpus.gpu_names, None):
        for config in configs:
            key = gpus.keys.get(config.name)
            if key is not None and key.gpu_name == gpu_name:
                rows.append(gpu_row(gpus.short(gpu_name), config))
    return rows


def gpu_lines(gpus: GpuConfigs, prices: Mapping[str, GpuPrice]) -> list[str]:
    """Each GPU, its full recorded name and its price (or that none was given), then any split sweep."""
    lines = []
    for gpu_name in gpus.gpu_names:
        price = prices.get(gpu_name)
        priced = (f"${price.price_per_gpu_hour:.3g}/GPU-hour from {price.source}" if price is not None else
                  f"no price given for {gpus.short(gpu_name)} (ranked by capacity per GPU)")
        lines.append(f"GPU {gpus.short(gpu_name)} ({gpu_name}): {priced}")
    if any(k.gpu_name is None for k in gpus.keys.values()):
        lines.append(f"GPU {gpus.short(None)}: some runs recorded no fixed.gpu_name; they are kept apart")
    return [*lines, *gpus.warnings]


def shows_gpus(gpus: GpuConfigs, prices: Mapping[str, GpuPrice]) -> bool:
    """The per-GPU section appears when the runs span several GPUs or prices were given per GPU."""
    return gpus.by_gpu or bool(prices)
