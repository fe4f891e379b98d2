"""One cost per accepted response, computed in one place and shown with its inputs.

The model: at a configuration's operating point, over its valid repeats,
    cost = price per GPU-hour × GPUs × Σ run time (h) / Σ accepted responses
where an accepted response completed and met every per-request bound. Its interval comes from the
accepted rate's (goodput's, else the completed rate's) interval: cost ∝ 1 / rate, so the rate's high
end gives the cost's low end. There is no built-in price: a price comes from the user (study.json,
a flag) and says where it came from; without one there is no cost, and the decision ranks by capacity
per GPU instead. The configurations table, the checklist and the headline all display `Cost.describe`.
"""

from __future__ import annotations

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
    """Accepted responses per second, pooled over the valid repeats (None: not measured)."""

    @property
    def per_accepted(self) -> float | None:
        """USD per accepted response (None: no price, or nothing accepted)."""
        price = self.model.price_per_gpu_hour
        if price is None or self.num_accepted == 0:
            return None
        return price * self.model.num_gpus * self.run_time_s / 3600.0 / self.num_accepted

    @property
    def interval(self) -> tuple[float, float] | None:
        """(low, high) USD per accepted response; always holds the estimate."""
        estimate, price, rate = self.per_accepted, self.model.price_per_gpu_hour, self.accepted_rate
        if estimate is None or price is None or rate is None:
            return None
        per_second = price * self.model.num_gpus / 3600.0
        low = per_second / rate.high if rate.high > 0 else 0.0
        high = per_second / rate.low if rate.low > 0 else math.inf
        return min(low, estimate), max(high, estimate)

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
        return f"{money(estimate, self.interval)} at ${price:.3g}/GPU-hour ({self.model.price_source})"

    def inputs(self) -> str:
        return (f"{self.model.describe_price()} × {self.run_time_s / 3600.0:.3g} h / "
                f"{self.num_accepted:,} accepted")


def money(value: float | None, interval: tuple[float, float] | None = None) -> str:
    """A cost per accepted response in words: "$0.25 per accepted response", "$0.139 [0.12, 0.15] per 1,000
    accepted responses"."""
    if value is None:
        return "n/a"
    scale, unit = (1.0, "per accepted response") if value >= 0.01 else (1000.0, "per 1,000 accepted responses")
    shown = f"${value * scale:.3g}"
    if interval is not None:
        high = "..." if math.isinf(interval[1]) else f"{interval[1] * scale:.3g}"
        shown += f" [{interval[0] * scale:.3g}, {high}]"
    return f"{shown} {unit}"
