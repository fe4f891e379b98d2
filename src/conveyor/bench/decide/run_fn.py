"""The run function a sweep calls for each repeat, and the one that runs a real benchmark.

The sweep (sweep.py) never starts a run itself: it calls a RunFn, so the search is tested with a fake
server. `make_run_fn` wires it to `conveyor.bench.measure.runner.run_benchmark`; a lengthened repeat
(lengthen.py) passes its request count, which the runner caps at the trace's length.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.bench.decide.run_options import RunOptions
from conveyor.bench.decide.slo import SLO
from conveyor.bench.decide.sweep_axis import SweepAxis
from conveyor.bench.measure.summary import RunSummary

RunFn = Callable[[float, int, pathlib.Path, int | None], RunSummary]
"""(offered rate, repeat index, run directory, requests to send or None for the run's own count) -> the
run's summary; must write the run directory."""


@dataclass(frozen=True)
class RunTemplate:
    """What stays fixed across a sweep's runs (everything of BenchRunConfig but the rate)."""

    base_url: str
    """Server URL, e.g. http://127.0.0.1:8000."""
    trace_path: str
    """The trace every run replays."""
    label: str
    """Configuration name; runs are labelled `<label>@<rate>#<repeat>`."""
    slo: SLO | None = None
    """Passed to the run for goodput."""
    options: RunOptions = field(default_factory=RunOptions)
    """Further BenchRunConfig fields (seed, num_requests, endpoint, model, burstiness, ...)."""
    axis: SweepAxis = SweepAxis.RATE
    """What the swept value sets: request_rate, or max_concurrency (a closed loop unless options give a rate)."""

    def __post_init__(self) -> None:
        if not isinstance(self.options, RunOptions):  # a plain mapping (a script, a test): read once, here
            object.__setattr__(self, "options", RunOptions.from_mapping(self.options, "run options"))


def make_run_fn(template: RunTemplate) -> RunFn:
    """A RunFn over `conveyor.bench.measure.runner.run_benchmark`; repeat k uses arrival seed `seed + k`, and a
    lengthened repeat replaces the template's num_requests."""

    def run(rate: float, repeat: int, run_dir: pathlib.Path, num_requests: int | None) -> RunSummary:
        from conveyor.bench.measure import runner  # the bench engineer's module; imported only when running

        options = template.options
        if num_requests is not None:  # a lengthened repeat; the runner sends at most the trace's requests
            options = dataclasses.replace(options, num_requests=num_requests)
        concurrency = template.axis is SweepAxis.CONCURRENCY
        label = f"{template.label}@c{rate:g}#{repeat}" if concurrency else f"{template.label}@{rate:.4g}#{repeat}"
        options = (dataclasses.replace(options, max_concurrency=int(rate)) if concurrency
                   else dataclasses.replace(options, request_rate=rate))
        cfg = runner.BenchRunConfig(
            base_url=template.base_url, trace_path=template.trace_path, out_dir=str(run_dir), label=label,
            seed=(options.seed or 0) + repeat, slo=template.slo, **dataclasses.replace(options, seed=None).given())
        return runner.run_benchmark(cfg)

    return run
