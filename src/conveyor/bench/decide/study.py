"""A configuration study: a baseline server configuration plus variants that change one parameter each.

The model: the study file (JSON or TOML) names the server command template, the trace, the objective,
the baseline's engine flags and the variants; each variant changes exactly ONE engine parameter of the
baseline (so any difference in the results has one cause). For every configuration the study launches
the server, health-checks and warms it up, runs a rate sweep (or the fixed `rates`), and stops it; the
layout written is `OUT/study.json`, `OUT/<config>/{command.txt, server.log, sweep.json, rate-*/}`, which
`conveyor report OUT` reads back. Launch and run are injected, so the orchestration is tested without a
server, and the same study file drives `conveyor serve` or `vllm serve` through the command template.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ContextManager

from conveyor.bench.decide.run_fn import RunFn, RunTemplate, make_run_fn
from conveyor.bench.decide.run_options import RunOptions, RunOptionsError, ServerOptions
from conveyor.bench.decide.slo import SLO, slo_from_mapping
from conveyor.bench.decide.sweep import SweepConfig, Sweeper, SweepResult
from conveyor.bench.jsonvalue import Fields
from conveyor.bench.load.launch import LaunchError, ServerProcess, ServerSpec
from conveyor.bench.measure.rundirs import STUDY_FILE
from conveyor.bench.table_file import read_table_file

_COST_KEYS = {"price_per_gpu_hour", "num_gpus"}
_SWEEP_KEYS = {f.name for f in fields(SweepConfig)} - {"slo"}


class StudyError(ValueError):
    """A malformed study file; names the key."""


@dataclass(frozen=True)
class Variant:
    """One configuration of the study."""

    name: str
    """Directory and report name."""
    args: dict[str, Any]
    """Engine flags (baseline merged with the one changed parameter)."""
    changed: str | None
    """The parameter this variant changes (None: the baseline)."""
    price_per_gpu_hour: float | None
    """USD per GPU-hour for the cost per accepted response (None: no price given; none is built in)."""
    num_gpus: int
    """GPUs per server."""
    trace_path: str | None = None
    """This configuration's own trace (None: the study's), e.g. to measure at another context length."""
    own_cost: bool = False
    """Prices its own GPUs (price_per_gpu_hour / num_gpus): the GPU may differ from the baseline's."""

    def varied_fixed_keys(self) -> list[str]:
        """The fixed things (fixed.FIXED_KEYS) this configuration changes on purpose."""
        keys = {"trace": ["trace_sha256"], "dtype": ["dtype"],
                "model": ["model_path", "model_config_sha256", "weights_sha256", "tokenizer_sha256"],
                "tokenizer": ["tokenizer_sha256"]}.get(self.changed or "", [])
        return keys + (["gpu_name", "gpu_count"] if self.own_cost else [])


@dataclass(frozen=True)
class StudySpec:
    """Everything a study needs, parsed and validated."""

    command: str
    """Server command template ({port}, {host}, {args})."""
    trace_path: str
    """Trace replayed at every point."""
    slo: SLO
    """The objective."""
    variants: tuple[Variant, ...]
    """Baseline first, then one per changed parameter."""
    sweep: SweepConfig
    """Rate search settings (ignored when `rates` is set)."""
    rates: tuple[float, ...] = ()
    """Fixed offered rates instead of a search."""
    main_rate: float | None = None
    """Offered rate of the main scenario (checklist)."""
    run_options: RunOptions = field(default_factory=RunOptions)
    """Further BenchRunConfig fields (num_requests, seed, endpoint, burstiness, ...)."""
    server_options: ServerOptions = field(default_factory=ServerOptions)
    """Further ServerSpec fields (env, health_path, startup_timeout_s, num_warmup_requests, model)."""
    planned_context_len: int | None = None
    """Context length (prompt + output tokens) the deployment plans for (checklist question 3)."""


def _variant(raw: Fields, i: int, baseline: dict[str, Any], cost: tuple[float | None, int]) -> Variant:
    """variants[i]: a name, exactly one changed parameter, and optionally its own GPU price and count."""
    changes: dict[str, Any] = dict(raw.data)
    name = str(changes.pop("name", "") or f"variant{i + 1}")
    own_cost = Fields({k: changes.pop(k) for k in list(changes) if k in _COST_KEYS}, raw.where)
    if len(changes) != 1:
        raise StudyError(f"variants[{i}] ({name}) must change exactly one parameter of the baseline, "
                         f"got {sorted(changes) or 'none'}")
    (key, value), = changes.items()
    if baseline.get(key) == value:
        raise StudyError(f"variants[{i}] ({name}) sets {key}={value!r}, the baseline's own value")
    args, trace = ({**baseline}, str(value)) if key == "trace" else ({**baseline, key: value}, None)
    own_price = own_cost.opt_number("price_per_gpu_hour") if "price_per_gpu_hour" in own_cost.data else cost[0]
    return Variant(name, args, key, own_price, own_cost.integer("num_gpus", cost[1]), trace, bool(own_cost.data))


def _variants(f: Fields) -> tuple[Variant, ...]:
    # The baseline's keys are engine flags (data, rendered into the command), so it stays a mapping.
    baseline = dict(f.child("baseline").data)
    price = f.opt_number("price_per_gpu_hour")  # no built-in price: a made-up one would rank by a made-up cost
    num_gpus = f.integer("num_gpus", 1)
    out = [Variant(f.text("baseline_name", "baseline"), baseline, None, price, num_gpus)]
    listed = f.raw("variants") or []
    if not isinstance(listed, list):
        raise StudyError(f"{f.where}: variants must be a list of tables, got {listed!r}")
    for i, raw in enumerate(listed):
        out.append(_variant(Fields.of(raw, f"{f.where} variants[{i}]"), i, baseline, (price, num_gpus)))
    names = [v.name for v in out]
    if len(set(names)) != len(names):
        raise StudyError(f"configuration names must be unique, got {names}")
    return tuple(out)


def spec_from_mapping(data: dict[str, Any], origin: str) -> StudySpec:
    f = Fields.of(data, origin)
    for key in ("command", "trace"):
        if not f.raw(key):
            raise StudyError(f"{origin}: missing {key!r} (e.g. command = \"conveyor serve --port {{port}} {{args}}\")")
    slo = slo_from_mapping(dict(f.child("slo").data), f"{origin} [slo]")
    sweep_data: dict[str, Any] = dict(f.child("sweep").data)
    rates = Fields(sweep_data, f"{origin} [sweep]").number_list("rates")
    sweep_data.pop("rates", None)
    unknown = set(sweep_data) - _SWEEP_KEYS
    if unknown:
        raise StudyError(f"{origin} [sweep]: unknown key(s) {sorted(unknown)}; known: {sorted(_SWEEP_KEYS)} + rates")
    try:
        run_options = RunOptions.from_mapping(f.child("run").data, f"{origin} [run]")
        server_options = ServerOptions.from_mapping(f.child("server").data, f"{origin} [server]")
    except RunOptionsError as error:
        raise StudyError(str(error)) from None
    return StudySpec(
        command=f.text("command"), trace_path=f.text("trace"), slo=slo, variants=_variants(f),
        sweep=SweepConfig(slo=slo, **sweep_data), rates=rates, main_rate=f.opt_number("main_rate"),
        run_options=run_options, server_options=server_options,
        planned_context_len=f.opt_integer("planned_context_len"))


def load_study_file(path: pathlib.Path) -> StudySpec:
    if not path.is_file():
        raise StudyError(f"study file {path} does not exist")
    data = read_table_file(path)
    return spec_from_mapping(data, str(path))


Launcher = Callable[[ServerSpec, pathlib.Path], ContextManager[str]]
"""(server spec, config directory) -> context manager yielding the base URL of a healthy server."""
RunFnFactory = Callable[[RunTemplate], RunFn]


@contextlib.contextmanager
def launch_server(spec: ServerSpec, out_dir: pathlib.Path) -> Iterator[str]:
    with ServerProcess(spec, out_dir) as server:
        yield server.base_url


def study_record(spec: StudySpec) -> dict[str, Any]:
    """What study.json keeps: the objective, costs and the exact configurations."""
    return {
        "command": spec.command, "trace": spec.trace_path, "slo": spec.slo.to_dict(), "main_rate": spec.main_rate,
        "planned_context_len": spec.planned_context_len,
        "configs": {v.name: {"args": v.args, "changed": v.changed, "price_per_gpu_hour": v.price_per_gpu_hour,
                             "num_gpus": v.num_gpus, "trace": v.trace_path or spec.trace_path,
                             "varies": v.varied_fixed_keys()} for v in spec.variants},
        "sweep": {k: v for k, v in asdict(spec.sweep).items() if k != "slo"}, "rates": list(spec.rates),
    }


@dataclass(frozen=True)
class ConfigurationRunner:
    """Runs the rates of one configuration whose server is already up."""

    spec: StudySpec
    """The study."""
    run_fn_factory: RunFnFactory = make_run_fn
    """Turns a run template into a run function (the real runner, or a fake in tests)."""
    progress: Callable[[str], None] = print
    """Where progress lines go."""

    def run(self, variant: Variant, base_url: str, config_dir: pathlib.Path) -> SweepResult:
        """Sweep (or run the fixed rates of) `variant`, served at `base_url`, into `config_dir`."""
        spec = self.spec
        template = RunTemplate(base_url, variant.trace_path or spec.trace_path, variant.name, spec.slo,
                               spec.run_options)
        sweeper = Sweeper(variant.name, spec.sweep, self.run_fn_factory(template), config_dir, self.progress)
        if not spec.rates:
            return sweeper.run()
        config_dir.mkdir(parents=True, exist_ok=True)
        for rate in spec.rates:
            point = sweeper.run_point(rate)
            sweeper.write()  # after every point: a study stopped midway keeps what it measured
            if point.runaway:
                break  # higher fixed rates would only pile up a queue that never drains
        return sweeper.write()


def server_spec(spec: StudySpec, variant: Variant) -> ServerSpec:
    return ServerSpec(name=variant.name, command=spec.command, args=variant.args, **spec.server_options.given())


def run_study(spec: StudySpec, out_dir: pathlib.Path, launcher: Launcher = launch_server,
              run_fn_factory: RunFnFactory = make_run_fn, progress: Callable[[str], None] = print,
              reverse_order: bool = False) -> pathlib.Path:
    """Launch, sweep and stop every configuration in turn (last to first with `reverse_order`: a check that
    the recommendation does not depend on run order; study.json keeps the study order, the baseline first,
    which breaks ties); returns `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    record = study_record(spec)
    (out_dir / STUDY_FILE).write_text(json.dumps(record, indent=2))
    ordered = spec.variants[::-1] if reverse_order else spec.variants
    for index, variant in enumerate(ordered, start=1):
        progress(f"[study] configuration {index}/{len(spec.variants)}: {variant.name} "
                 f"({variant.changed or 'baseline'})")
        config_dir = out_dir / variant.name
        try:
            with launcher(server_spec(spec, variant), config_dir) as base_url:
                result = ConfigurationRunner(spec, run_fn_factory, progress).run(variant, base_url, config_dir)
            record["configs"][variant.name]["max_rate_meeting"] = result.max_rate_meeting
        except LaunchError as error:  # a configuration that cannot start is an answer too (e.g. no KV memory)
            record["configs"][variant.name]["launch_error"] = _launch_reason(str(error))
            progress(f"[study] {variant.name} did not start: {record['configs'][variant.name]['launch_error']}")
        (out_dir / STUDY_FILE).write_text(json.dumps(record, indent=2))
    return out_dir


def _launch_reason(message: str) -> str:
    """The server's own last error line when its log tail names one, else the launch error's first line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines[1:] if "error" in line.lower()]
    return errors[-1] if errors else lines[0] if lines else "did not start"
