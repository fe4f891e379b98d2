"""summary.json's `cache` object: which prefix-cache state a run had, and how much of it it hit.

The model: a run's latency depends on what its prefix cache already held, so every run records its
cache mode (isolated: a per-run cache_salt; warm: a warm-up pass first; unknown: a run written before
this was recorded), the hit rate it measured and where that came from, and the hit rate the trace's own
sharing predicts (trace/prefix_share.py). The measured rate comes from the responses'
usage.prompt_tokens_details.cached_tokens over the measured requests when the server reports it (only
the run's own requests, exact), else from the delta of the server's prefix-cache counters over the run
(every request the server saw meanwhile). An isolated run whose rate departs from the trace's by more
than HIT_RATE_MARGIN gets a warning: it most likely hit (or missed) blocks it should not have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.bench.jsonvalue import JSON, Fields
from conveyor.bench.load.client import RequestRecord

HIT_RATE_MARGIN = 0.15
"""Absolute departure of the measured hit rate from the trace's own sharing that earns a warning: wider
than the estimate's error (block rounding, words vs tokens, chat templates), narrower than the 0.27 ->
0.905 jump of a run that inherited the previous run's cache (issue 33)."""


@dataclass(frozen=True)
class CacheSummary:
    """The run's prefix-cache state and hit rate."""

    mode: str = "unknown"
    """isolated | warm | unknown (a run recorded before cache modes existed)."""
    salt: str | None = None
    """The cache_salt every request carried (isolated runs)."""
    prefix_cache_hit_rate: float | None = None
    """Prompt tokens served from the prefix cache / prompt tokens (None: neither source reported it)."""
    hit_rate_source: str | None = None
    """usage (responses' cached_tokens, measured requests) | server_metrics (counter delta, whole run)."""
    expected_hit_rate: float | None = None
    """What the trace's own sharing lets a cache serve (trace/prefix_share.py)."""
    num_warm_pass_requests: int = 0
    """Requests of the warm-up pass (warm runs)."""
    warning: str | None = None
    """Why the measured rate is suspect, if it is."""

    @classmethod
    def from_json(cls, f: Fields) -> CacheSummary:
        return cls(f.text("mode", "unknown"), f.opt_text("salt"), f.opt_number("prefix_cache_hit_rate"),
                   f.opt_text("hit_rate_source"), f.opt_number("expected_hit_rate"),
                   f.integer("num_warm_pass_requests"), f.opt_text("warning"))

    def to_json(self) -> dict[str, JSON]:
        return {"mode": self.mode, "salt": self.salt, "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
                "hit_rate_source": self.hit_rate_source, "expected_hit_rate": self.expected_hit_rate,
                "num_warm_pass_requests": self.num_warm_pass_requests, "warning": self.warning}

    def describe(self) -> str:
        """One line for the console and the report."""
        rate = "-" if self.prefix_cache_hit_rate is None else f"{self.prefix_cache_hit_rate:.2f}"
        source = f" ({self.hit_rate_source})" if self.hit_rate_source else ""
        expected = "" if self.expected_hit_rate is None else f", trace's own sharing {self.expected_hit_rate:.2f}"
        return f"prefix cache: {self.mode}; hit rate {rate}{source}{expected}"


def usage_hit_rate(records: Sequence[RequestRecord]) -> float | None:
    """Sum of cached_tokens / sum of prompt_tokens over the records whose usage reported cached_tokens."""
    reported = [r for r in records if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in reported)
    return sum(r.cached_tokens or 0 for r in reported) / prompt if reported and prompt else None


def departure_warning(mode: str, measured: float | None, expected: float | None,
                      source: str = "usage") -> str | None:
    """The warning line when the measured rate departs from the trace's sharing by more than the margin."""
    if measured is None or expected is None or abs(measured - expected) <= HIT_RATE_MARGIN:
        return None
    if mode == "warm":
        return None  # a warm run hits more than the trace shares: that is what was asked for
    hint = ("it may have inherited a warm prefix cache (another client on the server, or a server that "
            "ignores cache_salt)" if measured > expected else "the server cached less than the trace shares "
            "(a small KV cache evicting blocks, or prefix caching off)")
    if measured > expected and source == "server_metrics":
        # The server's counters see every lookup: a request preempted and recomputed hits its own blocks.
        hint += ("; or preemptions: the server's counters also count a preempted request's recomputation "
                 "hitting its own blocks (serve with --enable-prompt-tokens-details for the run's own rate)")
    return (f"prefix-cache hit rate {measured:.2f} departs from the trace's own sharing {expected:.2f} by more "
            f"than {HIT_RATE_MARGIN}: {hint}")


def cache_summary(mode: str, salt: str | None, records: Sequence[RequestRecord], server_rate: float | None,
                  expected: float | None, num_warm_pass: int = 0) -> CacheSummary:
    """The run's CacheSummary: usage first (exact, the run's own requests), then the server's counters."""
    rate, source = usage_hit_rate(records), "usage"
    if rate is None:
        rate, source = server_rate, "server_metrics"
    return CacheSummary(mode=mode, salt=salt, prefix_cache_hit_rate=rate,
                        hit_rate_source=source if rate is not None else None, expected_hit_rate=expected,
                        num_warm_pass_requests=num_warm_pass, warning=departure_warning(mode, rate, expected, source))


def hit_rate_cell(cache: CacheSummary) -> str:
    """A dashboard cell: the hit rate and the cache state it was measured in, e.g. '0.27 isolated'."""
    rate = "-" if cache.prefix_cache_hit_rate is None else f"{cache.prefix_cache_hit_rate:.2f}"
    return f"{rate} {cache.mode}" + (" (!)" if cache.warning else "")


def cache_report_lines(runs: Sequence[tuple[str, CacheSummary]]) -> list[str]:
    """The report's lines: which cache state the runs had, then each run's warning."""
    if not runs:
        return []
    modes = sorted({c.mode for _, c in runs})
    counts = ", ".join(f"{sum(c.mode == m for _, c in runs)} {m}" for m in modes)
    lines = [f"Prefix cache: {counts} (isolated: a per-run cache_salt, no run hits another's blocks; warm: "
             "prompts replayed before measuring; unknown: recorded before cache modes)."]
    if len(modes) > 1:
        lines.append("WARNING: the runs were measured in different prefix-cache states; compare like with like.")
    lines.extend(f"WARNING ({label}): {c.warning}" for label, c in runs if c.warning)
    return lines
