"""One cost per accepted response, computed in one place and shown with its inputs.

The model: at a configuration's operating point, over its valid repeats,
    cost = price per GPU-hour × GPUs / 3600 / steady accepted rate
where the steady accepted rate is the accepted responses per second in the window the capacity rule
reads (run_stats.steady_accepted_rate: from the pipeline's fill, first send + p95 E2E, to the last send),
pooled over the repeats, and an accepted response completed and met every per-request bound. A run's
fill (few requests in flight) and drain (the tail after the last send) are not what a steadily loaded
server pays for (on the GPU study they were 3-6% of the whole run's cost). The estimate and its
interval are one quantity: cost ∝ 1 / rate, so the rate's high end gives the cost's low end, and cost ×
rate × 3600 is the price of one server-hour (what the checklist's servers cost). The whole run's figure
(price × GPUs × Σ run time / Σ accepted) stays shown beside it; it is the cost itself, said so
(`CostBasis.WHOLE_RUN`), when no run has a steady window (requests not recorded, or the sends stopped
before the pipeline filled). There is no built-in price: a price comes from the user (study.json, a flag)
and says where it came from; without one there is no cost, and the decision ranks by capacity per GPU
instead. The configurations table, the checklist and the headline all display `Cost.describe`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from conveyor.bench.measure.intervals import Interval


@dataclass(frozen=True)
class CostModel:
    """What one server of a configuration costs to run."""

    price_per_gpu_hour: float | None = None
    """USD per GPU-hour (None: no price given; the decision then ranks by capacity per GPU)."""
    num_gpus: int = 1
    """GPUs one server of this configuration holds."""
    price_source: str = "given"
    """Where the price came from (study.json, --price-per-gpu-hour, --price H100, a variant's own price)."""
    gpu: str | None = None
    """The GPU it runs on, when a report compares GPUs: "no price given" then says for which."""

    @property
    def priced(self) -> bool:
        return self.price_per_gpu_hour is not None

    def describe_price(self) -> str:
        if self.price_per_gpu_hour is None:
            return "no price given" + (f" for {self.gpu}" if self.gpu else "")
        gpus = f"{self.num_gpus} GPU" + ("s" if self.num_gpus != 1 else "")
        return f"${self.price_per_gpu_hour:.3g}/GPU-hour from {self.price_source} × {gpus}"


class CostBasis(enum.Enum):
    """Which accepted rate a cost divides the price by."""

    STEADY = "steady"
    """The steady window's accepted rate (run_stats.steady_accepted_rate)."""
    WHOLE_RUN = "whole_run"
    """Σ accepted / Σ run time, fill and drain included: only when no steady rate was measured."""


@dataclass(frozen=True)
class Cost:
    """USD per accepted response at one point, with its interval and the inputs it came from."""

    model: CostModel
    """The price and GPUs."""
    run_time_s: float
    """Σ run duration over the valid repeats."""
    num_accepted: int
    """Accepted responses over the valid repeats."""
    accepted_rate: Interval | None = None
    """The whole run's accepted responses per second, pooled over the valid repeats (None: not measured)."""
    steady_rate: Interval | None = None
    """Accepted responses per second in the steady window, pooled (None: no run had one)."""

    @property
    def basis(self) -> CostBasis:
        steady = self.steady_rate is not None and self.steady_rate.estimate > 0
        return CostBasis.STEADY if steady else CostBasis.WHOLE_RUN

    @property
    def per_second(self) -> float | None:
        """USD per second of one server (None: no price)."""
        price = self.model.price_per_gpu_hour
        return None if price is None else price * self.model.num_gpus / 3600.0

    @property
    def per_accepted_whole_run(self) -> float | None:
        """USD per accepted response over whole runs, fill and drain included (None: no price, or nothing
        accepted)."""
        per_second = self.per_second
        if per_second is None or self.num_accepted == 0:
            return None
        return per_second * self.run_time_s / self.num_accepted

    @property
    def per_accepted(self) -> float | None:
        """USD per accepted response on `basis` (None: no price, or nothing accepted)."""
        per_second, rate = self.per_second, self.steady_rate
        if self.basis is CostBasis.WHOLE_RUN or per_second is None or rate is None:
            return self.per_accepted_whole_run
        return per_second / rate.estimate

    @property
    def interval(self) -> tuple[float, float] | None:
        """(low, high) USD per accepted response; always holds the estimate. On the steady basis it is the
        steady rate's interval turned over; on the whole run's, the whole run's rate's, widened to hold the
        estimate (its rate counts the ends over Σ gaps, the estimate over Σ durations)."""
        estimate, per_second = self.per_accepted, self.per_second
        rate = self.steady_rate if self.basis is CostBasis.STEADY else self.accepted_rate
        if estimate is None or per_second is None or rate is None:
            return None
        low = per_second / rate.high if rate.high > 0 else 0.0
        high = per_second / rate.low if rate.low > 0 else math.inf
        return min(low, estimate), max(high, estimate)

    @property
    def server_hour(self) -> float | None:
        """USD per hour of one server (the checklist provisions servers with it; None: no price). On the
        steady basis it equals cost × steady accepted rate × 3600, so the two cost figures agree."""
        per_second = self.per_second
        return None if per_second is None else per_second * 3600.0

    def describe(self) -> str:
        """"$0.0556 [0.0500, 0.0625] per 1,000 accepted responses ($2/GPU-hour from study.json × 1 GPU ...)"."""
        estimate = self.per_accepted
        if estimate is None:
            return self.model.describe_price() if not self.model.priced else "n/a (nothing accepted)"
        return f"{money(estimate, self.interval)} ({self.inputs()})"

    def short(self) -> str:
        """The headline's form: the cost with its interval and the price it rests on, without the run time
        and counts (the table and the reasons show those)."""
        estimate, price = self.per_accepted, self.model.price_per_gpu_hour
        if estimate is None or price is None:
            return self.describe()
        basis = "" if self.basis is CostBasis.STEADY else ", whole run: no steady window"
        return f"{money(estimate, self.interval)} at ${price:.3g}/GPU-hour ({self.model.price_source}{basis})"

    def inputs(self) -> str:
        whole = (f"{self.model.describe_price()} × {self.run_time_s / 3600.0:.3g} h / "
                 f"{self.num_accepted:,} accepted")
        rate = self.steady_rate
        if self.basis is CostBasis.WHOLE_RUN or rate is None:
            return f"{whole}; whole run incl. fill and drain: no steady window measured"
        run_cost = self.per_accepted_whole_run
        # on the estimate's scale, so the two read side by side ("per 1,000" both)
        shown = "n/a" if run_cost is None else f"${run_cost * _scale(self.per_accepted or run_cost):.3g}"
        return (f"{self.model.describe_price()} / {rate.estimate:.3g} [{rate.low:.3g}, {rate.high:.3g}] accepted/s "
                f"steady; whole run incl. fill and drain: {shown} ({whole})")


def _scale(value: float) -> float:
    return 1.0 if value >= 0.01 else 1000.0


def money(value: float | None, interval: tuple[float, float] | None = None) -> str:
    """A cost per accepted response in words: "$0.25 per accepted response", "$0.139 [0.12, 0.15] per 1,000
    accepted responses"."""
    if value is None:
        return "n/a"
    scale = _scale(value)
    unit = "per accepted response" if scale == 1.0 else "per 1,000 accepted responses"
    shown = f"${value * scale:.3g}"
    if interval is not None:
        high = "..." if math.isinf(interval[1]) else f"{interval[1] * scale:.3g}"
        shown += f" [{interval[0] * scale:.3g}, {high}]"
    return f"{shown} {unit}"
