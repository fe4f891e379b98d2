"""Simulate, then verify: a study run first on the simulator, to shortlist what is worth a server's time.

`conveyor simulate --study STUDY.toml --calibration C.json --out-dir DIR --shortlist K` runs the very study
`conveyor bench study` would run (bench/decide/study.py: the same configurations, sweep, repeats and
objective) with the simulator standing in for the servers: the launcher "starts" a configuration by
building its engine setup, and each run replays the trace on it (sim/replay.py) into a simulated run
directory. DIR is then a study directory like a measured one (`conveyor report DIR` decides on it, every
run marked simulated). The shortlist is the baseline plus the K configurations with the highest
simulated capacity (the highest offered rate meeting the objective), written as DIR/shortlist.json: the
study file with only those variants, for `conveyor bench study` to verify on real servers.

Only what the simulation models can be varied: scheduler limits and policy, block size, prefix caching,
the pool size, and the trace; rate and concurrency sweeps alike. A variant that changes anything else
(the model, dtype, tensor parallelism, CUDA graphs) changes what a step costs, which one calibration
cannot say: it is refused. With `--target-gpu` the study runs on a GPU of the catalog the calibration was
not measured on: its terms scaled (sim/cross_hardware.py), each configuration's KV pool from the memory plan.
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from conveyor.bench.decide.run_fn import RunFn, RunTemplate
from conveyor.bench.decide.study import StudySpec, run_study
from conveyor.bench.decide.sweep_axis import SweepAxis
from conveyor.bench.jsonvalue import Fields
from conveyor.bench.load.launch import ServerSpec
from conveyor.bench.measure.summary import RunSummary, Simulated
from conveyor.bench.measure.window import WindowConfig
from conveyor.bench.report.dashboard import ReportInputs, analyze
from conveyor.bench.table_file import read_table_file
from conveyor.bench.trace.traces import read_trace
from conveyor.sim.cross_hardware import PoolSize
from conveyor.sim.engine_setup import SIMULATED_FLAGS, EngineSetup, apply_flags
from conveyor.sim.replay import StepPrice, replay
from conveyor.sim.run_dir import SimRunSpec, write_run_dir
from conveyor.sim.workload import LoadSettings

SHORTLIST_FILE = "shortlist.json"
_VARIABLE = SIMULATED_FLAGS | {"num_gpu_blocks_override", "trace"}


def check_simulable(spec: StudySpec) -> None:
    """ValueError naming the first variant the simulation cannot model (module docstring)."""
    for variant in spec.variants:
        if variant.changed is not None and variant.changed not in _VARIABLE:
            raise ValueError(f"--study: variant {variant.name} changes {variant.changed}, which changes what a step "
                             "costs; one calibration cannot price it: drop it here and measure it on a server")


@dataclass
class SimulatedServers:
    """Bench's launcher and run-function factory, with the simulator behind them."""

    base: EngineSetup
    """The engine before a configuration's flags (simulate's own flags on the engine defaults)."""
    step_time: StepPrice
    simulated: Simulated
    pool: PoolSize | None = None
    """`--target-gpu`: each configuration's pool from the memory plan at its own limits, as a server on that
    GPU would size it (a configuration that sets num_gpu_blocks_override keeps its own); None: the base's."""
    setups: dict[str, EngineSetup] = field(default_factory=dict)
    """base URL handed to the study -> the configuration's engine."""

    @contextlib.contextmanager
    def launch(self, server: ServerSpec, config_dir: pathlib.Path) -> Iterator[str]:
        config_dir.mkdir(parents=True, exist_ok=True)
        url = f"simulated://{server.name}"
        flags = {key: str(value) for key, value in server.args.items() if key in _VARIABLE}
        setup = apply_flags(self.base, flags, f"--study configuration {server.name}")
        if self.pool is not None and "num_gpu_blocks_override" not in flags:
            setup = replace(setup, num_blocks=self.pool(setup))
        self.setups[url] = setup
        yield url

    def run_fn(self, template: RunTemplate) -> RunFn:
        setup, trace = self.setups[template.base_url], read_trace(template.trace_path)
        options = Fields.of(template.options.given(), "--study [run]")

        def run(rate: float, repeat: int, run_dir: pathlib.Path, num_requests: int | None) -> RunSummary:
            closed = template.axis is SweepAxis.CONCURRENCY  # the swept value is the cap, as bench's run function
            request_rate = options.number("request_rate", math.inf) if closed else rate
            load = LoadSettings(request_rate=request_rate,
                                arrival=options.opt_text("arrival"), profile=options.opt_text("profile"),
                                max_concurrency=int(rate) if closed else options.opt_integer("max_concurrency"),
                                burstiness=options.number("burstiness", 1.0), time_scale=options.number("time_scale", 1.0),
                                seed=options.integer("seed") + repeat,  # as bench's run function: repeat k, seed + k
                                num_requests=requests_to_send(options, request_rate, num_requests))
            label = f"{template.label}@c{rate:g}#{repeat}" if closed else f"{template.label}@{rate:.4g}#{repeat}"
            spec = SimRunSpec(label, template.trace_path, trace, load, setup, self.simulated,
                              window=run_window(options))
            return write_run_dir(run_dir, spec, replay(spec, self.step_time), "conveyor simulate --study")

        return run


def requests_to_send(options: Fields, request_rate: float, lengthened: int | None) -> int | None:
    """How many of the trace's first requests a run sends, by bench's rule (BenchRunConfig.num_to_send): a
    lengthened repeat's count, else [run] num_requests, else ceil(rate × duration_s), else the whole trace.
    Without it a study of `duration_s` runs would replay the whole trace at every rate: more requests than
    the servers were sent, so a longer queue past capacity and a different verdict."""
    given, duration_s = lengthened or options.opt_integer("num_requests"), options.opt_number("duration_s")
    if given is not None or duration_s is None:
        return given
    if not (duration_s > 0 and math.isfinite(request_rate)):
        raise ValueError(f"--study [run]: duration_s must be > 0 s with a finite rate, got {duration_s}")
    return max(1, math.ceil(request_rate * duration_s))


def run_window(options: Fields) -> WindowConfig:
    """[run]'s warm-up and cool-down, as bench's runner leaves them out of each summary."""
    return WindowConfig(warmup_requests=options.integer("warmup_requests"), warmup_s=options.number("warmup_s"),
                        cooldown_requests=options.integer("cooldown_requests"),
                        cooldown_s=options.number("cooldown_s"))


def simulate_study(spec: StudySpec, servers: SimulatedServers, out_dir: pathlib.Path) -> None:
    check_simulable(spec)
    run_study(spec, out_dir, launcher=servers.launch, run_fn_factory=servers.run_fn, progress=lambda _: None)


@dataclass(frozen=True)
class Shortlisted:
    name: str
    max_rate_meeting: float | None
    """The simulated capacity it was ranked by (None: no rate met the objective)."""


def shortlist(spec: StudySpec, out_dir: pathlib.Path, size: int) -> list[Shortlisted]:
    """The baseline, then the `size` other configurations of highest simulated capacity (ties: study order)."""
    analysis = analyze(ReportInputs((out_dir,), allow_mixed=True))  # a variant's own trace differs on purpose
    capacity = {c.name: c.max_rate_meeting for c in analysis.configs}
    baseline, others = spec.variants[0].name, [v.name for v in spec.variants[1:]]
    ranked = sorted(others, key=lambda name: -(capacity.get(name) or 0.0))  # sorted is stable: study order
    return [Shortlisted(name, capacity.get(name)) for name in [baseline, *ranked[:size]]]


def write_shortlist(study_file: pathlib.Path, spec: StudySpec, chosen: list[Shortlisted],
                    out_dir: pathlib.Path) -> pathlib.Path:
    """The study file with only the chosen variants (matched by position: a variant's name may be implicit)."""
    table = Fields.of(read_table_file(study_file), str(study_file))
    data, raw = dict(table.data), table.raw("variants")
    names = {c.name for c in chosen}
    variants = raw if isinstance(raw, list) else []
    data["variants"] = [v for v, parsed in zip(variants, spec.variants[1:]) if parsed.name in names]
    path = out_dir / SHORTLIST_FILE
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path
