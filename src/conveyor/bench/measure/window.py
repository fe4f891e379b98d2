"""The steady-state window: which requests of a run count in its summary.

Every request is sent and recorded (requests.jsonl keeps them all, each with `in_window`), but the first
ones meet a cold server (empty prefix cache, lazy initialisation, a batch still filling) and, in a closed
loop or at the end of a trace, the last ones meet a draining one. As AIPerf's warm-up count and GuideLLM's
warm-up/cool-down, a request is measured only if it was *sent* after the warm-up (the first
`warmup_requests` sends, and every send in the first `warmup_s` seconds) and before the cool-down (the
last `cooldown_requests` sends, and every send in the last `cooldown_s` seconds before the final send).
Latency percentiles, throughputs and goodput are then over the measured requests, and the duration runs
from the first measured send to the last measured end, the same rule as for a whole run. Send lag is
judged over every request: a client that fell behind during warm-up still measured itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.bench.load.client import RequestRecord


@dataclass(frozen=True)
class WindowConfig:
    """What is left out of the summary at each end of the run."""

    warmup_requests: int = 0
    """The first N requests sent are warm-up."""
    warmup_s: float = 0.0
    """Requests sent in the first S seconds of the run are warm-up."""
    cooldown_requests: int = 0
    """The last N requests sent are cool-down."""
    cooldown_s: float = 0.0
    """Requests sent in the last S seconds before the final send are cool-down."""

    def __post_init__(self) -> None:
        if min(self.warmup_requests, self.cooldown_requests) < 0 or min(self.warmup_s, self.cooldown_s) < 0:
            raise ValueError("--warmup-requests, --warmup-s, --cooldown-requests and --cooldown-s must be >= 0")

    @property
    def is_whole_run(self) -> bool:
        return not (self.warmup_requests or self.warmup_s or self.cooldown_requests or self.cooldown_s)


def apply_window(records: list[RequestRecord], cfg: WindowConfig) -> dict[str, Any]:
    """Mark each record's in_window; return the summary's `window` entry."""
    by_send = sorted(records, key=lambda r: r.sent_s)
    last_sent_s = by_send[-1].sent_s if by_send else 0.0
    num_warmup = num_cooldown = 0
    for i, rec in enumerate(by_send):
        warmup = i < cfg.warmup_requests or rec.sent_s < cfg.warmup_s
        cooldown = i >= len(by_send) - cfg.cooldown_requests or rec.sent_s > last_sent_s - cfg.cooldown_s
        rec.in_window = not (warmup or cooldown)
        num_warmup += warmup
        num_cooldown += cooldown and not warmup
    measured = [r.sent_s for r in by_send if r.in_window]
    window: dict[str, Any] = {
        "warmup_requests": cfg.warmup_requests, "warmup_s": cfg.warmup_s,
        "cooldown_requests": cfg.cooldown_requests, "cooldown_s": cfg.cooldown_s,
        "num_warmup": num_warmup, "num_cooldown": num_cooldown, "num_measured": len(measured),
        "start_s": round(measured[0], 6) if measured else None,
        "end_s": round(measured[-1], 6) if measured else None,
    }
    window["label"] = window_label(window, len(records))
    return window


def window_label(window: dict[str, Any], num_sent: int) -> str:
    """One line for tables and reports, e.g. 'steady state: 180 of 200 requests (sent 4.9-59.8 s); ...'."""
    if window["num_warmup"] == 0 and window["num_cooldown"] == 0:
        return f"whole run: all {num_sent} requests measured"
    span = "" if window["start_s"] is None else f" (sent {window['start_s']:.1f}-{window['end_s']:.1f} s)"
    return (f"steady state: {window['num_measured']} of {num_sent} requests{span}; "
            f"{window['num_warmup']} warm-up, {window['num_cooldown']} cool-down excluded")
