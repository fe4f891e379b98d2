"""Client-side metrics: per-request records in, summary.json keys out (pure functions, no I/O).

Definitions are `vllm bench serve`'s (docs/architecture.md §4, docs/benchmarking.md): latency statistics
are over completed requests only; ITL is pooled over all completed requests' gaps; TPOT is per request
(e2e − ttft)/(output_tokens − 1); percentiles are numpy's linear interpolation and std is the
population std, as vLLM computes them; duration runs from the first dispatch to the last request's end;
throughputs divide by it. Goodput counts completed requests meeting every per-request bound given
(ttft, tpot, e2el as vLLM's --goodput; itl = the request's largest gap), divided by the duration.
Cancelled requests are neither successes nor failures: error_rate = failed / (sent − cancelled).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from conveyor.bench.load.client import RequestRecord, RequestStatus

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class GoodputBounds:
    """Per-request bounds a request must all meet to count towards goodput (milliseconds)."""

    ttft_ms: float | None = None
    """Time to first token."""
    tpot_ms: float | None = None
    """Time per output token after the first."""
    itl_ms: float | None = None
    """Largest inter-token gap of the request."""
    e2el_ms: float | None = None
    """End-to-end latency."""

    def is_empty(self) -> bool:
        return all(v is None for v in (self.ttft_ms, self.tpot_ms, self.itl_ms, self.e2el_ms))

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "itl_ms": self.itl_ms, "e2el_ms": self.e2el_ms}


def parse_goodput(spec: str) -> GoodputBounds:
    """`ttft:200,tpot:50` (vLLM's --goodput syntax, values in ms; also itl and e2el)."""
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition(":")
        if not sep or name not in LATENCY_METRICS:
            raise ValueError(f"--goodput: {part!r} must be NAME:MS with NAME one of {', '.join(LATENCY_METRICS)}")
        try:
            values[f"{name}_ms"] = float(value)
        except ValueError as exc:
            raise ValueError(f"--goodput: {value!r} in {part!r} is not a number of milliseconds") from exc
        if values[f"{name}_ms"] <= 0:
            raise ValueError(f"--goodput: {part!r} must be > 0 ms")
    return GoodputBounds(**values)


def latency_stats(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    """mean/median/std/p50/p90/p95/p99 in ms, keyed as vLLM (`p95_ttft_ms`); None when no data."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"] + [f"p{p}_{name}_ms" for p in PERCENTILES]
    if not values_s:
        return dict.fromkeys(keys, None)
    ms = np.asarray(values_s, dtype=float) * 1000.0
    stats = [float(np.mean(ms)), float(np.median(ms)), float(np.std(ms))]
    stats += [float(np.percentile(ms, p)) for p in PERCENTILES]
    return dict(zip(keys, stats))


def latency_values(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    done = [r for r in records if r.status is RequestStatus.COMPLETED]
    return {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [gap for r in done for gap in r.itl_s],
        "e2el": [r.e2e_s for r in done if r.e2e_s is not None],
    }


def duration_s(records: Sequence[RequestRecord]) -> float:
    """First dispatch to last end."""
    ends = [r.end_s for r in records if r.end_s is not None]
    if not records or not ends:
        return 0.0
    return max(ends) - min(r.sent_s for r in records)


def meets_bounds(r: RequestRecord, b: GoodputBounds) -> bool:
    checks = [(b.ttft_ms, r.ttft_s), (b.tpot_ms, r.tpot_s or 0.0), (b.e2el_ms, r.e2e_s),
              (b.itl_ms, max(r.itl_s, default=0.0))]
    return all(bound is None or (value is not None and value * 1000.0 <= bound) for bound, value in checks)


def count_status(records: Sequence[RequestRecord]) -> dict[str, int]:
    statuses = [r.status for r in records]
    return {"num_prompts": len(records), "completed": statuses.count(RequestStatus.COMPLETED),
            "failed": statuses.count(RequestStatus.FAILED), "cancelled": statuses.count(RequestStatus.CANCELLED)}


def error_rate(counts: dict[str, int]) -> float:
    denominator = counts["num_prompts"] - counts["cancelled"]
    return counts["failed"] / denominator if denominator > 0 else 0.0


def client_summary(records: Sequence[RequestRecord], bounds: GoodputBounds | None) -> dict[str, Any]:
    """The client half of summary.json (everything but identity, validity and server keys)."""
    counts = count_status(records)
    dur = duration_s(records)
    done = [r for r in records if r.status is RequestStatus.COMPLETED]
    in_tokens = sum(r.prompt_tokens for r in done)
    out_tokens = sum(r.output_tokens for r in done)
    out: dict[str, Any] = dict(counts, duration=dur, total_input_tokens=in_tokens, total_output_tokens=out_tokens)
    out["request_throughput"] = counts["completed"] / dur if dur > 0 else 0.0
    out["output_throughput"] = out_tokens / dur if dur > 0 else 0.0
    out["total_token_throughput"] = (in_tokens + out_tokens) / dur if dur > 0 else 0.0
    for name, values in latency_values(records).items():
        out.update(latency_stats(name, values))
    use = bounds is not None and not bounds.is_empty()
    out["slo"] = bounds.as_dict() if bounds is not None and use else {}
    out["goodput"] = (sum(meets_bounds(r, bounds) for r in done) / dur if dur > 0 else 0.0) if (
        bounds is not None and use) else None
    out["error_rate"] = error_rate(counts)
    kinds: dict[str, int] = {}
    for r in records:
        if r.error_kind is not None:
            kinds[r.error_kind.value] = kinds.get(r.error_kind.value, 0) + 1
    out["errors_by_kind"] = kinds
    out["per_class"] = {c: class_summary([r for r in records if r.request_class == c], dur)
                        for c in sorted({r.request_class for r in records})}
    return out


def class_summary(records: Sequence[RequestRecord], dur: float) -> dict[str, Any]:
    """One class over the whole run's duration (so per-class throughputs add up to the total)."""
    counts = count_status(records)
    values = latency_values(records)
    out: dict[str, Any] = dict(counts)
    done = [r for r in records if r.status is RequestStatus.COMPLETED]
    out["request_throughput"] = counts["completed"] / dur if dur > 0 else 0.0
    out["output_throughput"] = sum(r.output_tokens for r in done) / dur if dur > 0 else 0.0
    for name in ("ttft", "e2el", "itl"):
        stats = latency_stats(name, values[name])
        for p in (50, 95, 99) if name != "itl" else (50, 95):
            out[f"p{p}_{name}_ms"] = stats[f"p{p}_{name}_ms"]
    out["error_rate"] = error_rate(counts)
    return out


def send_lag_p99_ms(records: Sequence[RequestRecord]) -> float:
    if not records:
        return 0.0
    return float(np.percentile([r.send_lag_s * 1000.0 for r in records], 99))


def validity(lag_p99_ms: float, bound_ms: float) -> tuple[bool, str | None]:
    """A run whose client fell behind measured the client, not the server."""
    if lag_p99_ms > bound_ms:
        return False, (f"p99 send lag {lag_p99_ms:.2f} ms exceeds the {bound_ms:g} ms bound: the load generator "
                       f"could not keep up with the offered rate; lower --rate or use a bigger client machine")
    return True, None
