"""Runs keyed by the GPU they measured: a configuration is (GPU, configuration name), never pooled across GPUs.

The model: summary.json `fixed.gpu_name` (fixed.py) says which GPU a run measured. When the runs span
more than one GPU, each configuration's name gets its GPU's short name ("baseline on H100"), so a study
named `baseline` on the H100 and one on the H200 are two configurations, and every later stage (points,
decision, report) keeps them apart by name alone. One sweep directory is one configuration: runs of two
GPUs inside it are refused (MixedGpuError, naming the GPUs), unless allow_mixed, which splits them by
GPU and warns (as --allow-mixed compares other differing fixed things, with a warning, never pooled).
Each configuration keeps its own study's record (price, what it changes, what it varies), read from the
study.json above its runs: two studies' `baseline`s keep their own prices.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from conveyor.bench.jsonvalue import Fields
from conveyor.bench.measure.fixed import FixedDifference, FixedRecord, differences
from conveyor.bench.measure.rundirs import (
    RunResult,
    StudyConfig,
    StudyFile,
    read_study_file,
    study_dir,
    sweep_dir,
)

UNKNOWN_GPU = "unknown GPU"
GPU_KEY = "gpu_name"
PER_MACHINE = (GPU_KEY, "gpu_count")
"""Fixed things another GPU changes by design: its name, and how many GPUs its host shows."""


class MixedGpuError(ValueError):
    """Runs of different GPUs inside one configuration, or studies judged against different objectives."""


def run_gpu(run: RunResult) -> str | None:
    """The GPU the run measured (None: not recorded)."""
    return Fields.of(dict(run.summary.fixed), f"{run.run_dir}/summary.json fixed").opt_text(GPU_KEY)


@dataclass(frozen=True)
class ConfigKey:
    """What a configuration is, across machines."""

    gpu_name: str | None
    """fixed.gpu_name of its runs (None: not recorded)."""
    name: str
    """Its name in its sweep or study."""


@dataclass(frozen=True)
class GpuConfigs:
    """The runs with their configurations keyed by GPU."""

    runs: tuple[RunResult, ...] = ()
    """Every run; its config_name is its configuration's label."""
    keys: Mapping[str, ConfigKey] = field(default_factory=dict)
    """Label -> (GPU, name), in first-seen order."""
    short_names: Mapping[str, str] = field(default_factory=dict)
    """gpu_name -> the short name labels and prices show ("H100")."""
    warnings: tuple[str, ...] = ()
    """Sweeps split by GPU under allow_mixed."""

    @property
    def gpu_names(self) -> tuple[str, ...]:
        """The GPUs recorded, in first-seen order."""
        return tuple(dict.fromkeys(k.gpu_name for k in self.keys.values() if k.gpu_name is not None))

    @property
    def by_gpu(self) -> bool:
        """Whether the runs span more than one GPU (an unknown one counts as one more)."""
        return len({k.gpu_name for k in self.keys.values()}) > 1

    def short(self, gpu_name: str | None) -> str:
        return UNKNOWN_GPU if gpu_name is None else self.short_names.get(gpu_name, gpu_name)


def short_gpu_names(gpu_names: Sequence[str]) -> dict[str, str]:
    """gpu_name -> the short name a report shows ("NVIDIA H100 80GB HBM3" -> "H100"): the first word
    that starts with a letter and holds a digit, else the name without its vendor; the full names when
    two short ones would collide (two GPUs must never read as one)."""
    short = {name: _short(name) for name in gpu_names}
    if len(set(short.values())) < len(short):
        return {name: name for name in gpu_names}
    return short


def _short(gpu_name: str) -> str:
    words = gpu_name.removeprefix("NVIDIA ").split()
    model = next((w for w in words if w[:1].isalpha() and any(c.isdigit() for c in w)), None)
    return model or " ".join(words) or gpu_name


def _mixed_sweeps(runs: list[RunResult]) -> list[str]:
    """One description per sweep whose runs recorded different GPUs."""
    by_sweep: dict[pathlib.Path, dict[str, list[str]]] = {}
    for run in runs:
        sweep, gpu = sweep_dir(run.run_dir), run_gpu(run)
        if sweep is not None and gpu is not None:
            by_sweep.setdefault(sweep, {}).setdefault(gpu, []).append(run.label)
    return [f"{sweep} mixes GPUs: " + "; ".join(f"{gpu} ({', '.join(labels[:3])})" for gpu, labels in gpus.items())
            for sweep, gpus in by_sweep.items() if len(gpus) > 1]


def key_runs(runs: list[RunResult], allow_mixed: bool) -> GpuConfigs:
    """Each run relabelled with its (GPU, configuration) when the runs span several GPUs; raises
    MixedGpuError on a sweep of two GPUs unless allow_mixed."""
    mixed = _mixed_sweeps(runs)
    if mixed and not allow_mixed:
        raise MixedGpuError("; ".join(mixed) + ". Runs of different GPUs are never one configuration: keep each "
                            "GPU's runs in its own sweep or study, or pass --allow-mixed to split them by GPU.")
    keyed = [(run, ConfigKey(run_gpu(run), run.config_name)) for run in runs]
    several = len({key.gpu_name for _, key in keyed}) > 1
    short_names = short_gpu_names(list(dict.fromkeys(k.gpu_name for _, k in keyed if k.gpu_name is not None)))

    def label(key: ConfigKey) -> str:
        gpu = UNKNOWN_GPU if key.gpu_name is None else short_names.get(key.gpu_name, key.gpu_name)
        return f"{key.name} on {gpu}" if several else key.name

    keys = {label(key): key for _, key in keyed}
    relabelled = tuple(dataclasses.replace(run, config_name=label(key)) for run, key in keyed)
    warnings = tuple(f"--allow-mixed: {m}; split into one configuration per GPU" for m in mixed)
    return GpuConfigs(relabelled, keys, short_names, warnings)


def config_studies(gpus: GpuConfigs, base: StudyFile, objective_given: bool) -> StudyFile:
    """The study records keyed by label, each configuration's own (from the study.json above its runs)
    with the GPU (name and count) a thing it varies on purpose (what a comparison across GPUs is for), in
    GPU order, then the order the studies were given, then each study's order (the baseline first: ties
    go to it). Unchanged when the runs are of one GPU. Studies whose objectives differ are refused unless
    the objective is given: their configurations would be judged by different bounds."""
    if not gpus.by_gpu:
        return base
    studies = _studies(gpus)
    order: list[tuple[int, int, int, str, StudyConfig]] = []
    gpu_order, study_order = [k.gpu_name for k in gpus.keys.values()], list(studies)
    for label, key in gpus.keys.items():
        where = _study_of(gpus, label)
        own = studies[where].configs if where in studies else {}
        record = own[key.name] if key.name in own else StudyConfig()
        position = list(own).index(key.name) if key.name in own else len(own)
        study_index = study_order.index(where) if where in studies else len(study_order)
        order.append((gpu_order.index(key.gpu_name), study_index, position, label,
                      dataclasses.replace(record, varies=(*record.varies, *PER_MACHINE))))
    objectives = {_objective(s): where for where, s in studies.items()}
    if len(objectives) > 1 and not objective_given:
        raise MixedGpuError("the studies' objectives differ (" + "; ".join(f"{w}: {o}" for o, w in objectives.items())
                            + "); pass --slo to judge every GPU against one objective")
    return dataclasses.replace(base, configs={label: record for *_, label, record in sorted(order)})


def _objective(study: StudyFile) -> str:
    return ",".join(f"{k}={v:g}" for k, v in sorted(study.slo.items()) if v is not None) or "none"


def _study_of(gpus: GpuConfigs, label: str) -> pathlib.Path | None:
    return study_dir(next(r for r in gpus.runs if r.config_name == label).run_dir)


def _studies(gpus: GpuConfigs) -> dict[pathlib.Path, StudyFile]:
    """Every study.json above the runs, read once, in the order the runs were given."""
    found = dict.fromkeys(_study_of(gpus, label) for label in gpus.keys)
    return {where: read_study_file(where / "study.json") for where in found if where is not None}


def within_gpu_differences(records: list[FixedRecord]) -> list[FixedDifference]:
    """gpu_count differing between runs of one GPU. Across GPUs it belongs to the other machine and is
    exempt (config_studies); between runs of one GPU it is still a different machine."""
    groups: dict[str | None, list[FixedRecord]] = {}
    for record in records:
        groups.setdefault(Fields.of(record.fixed, record.run_label).opt_text(GPU_KEY), []).append(record)
    return [d for group in groups.values() for d in differences(group, {}) if d.key in PER_MACHINE]
