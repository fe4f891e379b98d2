"""Per-phase host time of a ModelRunner step, for spec_decode_step.py's --phases (issue 14's attribution).

The model: the runner's step is a tree of calls; each phase below is one callable wrapped in place
(a module global the runner looks up at call time, or an attribute of this runner's objects), and
the clock keeps each phase's *exclusive* time -- its own minus that of the phases it called -- so
the phases of a step add up to the whole step, and "execute" is what the runner does outside every
named phase (the speculative step's bookkeeping, the handle, the checks). Python's garbage collector
is a phase of its own ("gc", through `gc.callbacks`), taken out of whichever phase it interrupted. CPU time is this process's
(`time.process_time_ns`: with one torch thread, the host work itself, not the waits for a shared
core); wall time comes along. On CUDA each boundary synchronizes the device, so a phase holds its
kernels and overlap is gone: that is an attribution, not the step's real time.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import conveyor.worker.model_runner as model_runner_module
import conveyor.worker.spec_decode.ngram_proposer as ngram_module
import conveyor.worker.spec_decode.spec_decoder as spec_decoder_module
from conveyor.worker.model_runner import ModelRunner


class PhaseClock:
    """Exclusive CPU and wall nanoseconds per (runner, phase); `current` names the runner being timed."""

    def __init__(self, sync: Callable[[], None] | None) -> None:
        self.sync = sync
        self.current = ""
        self.cpu_ns: dict[tuple[str, str], int] = defaultdict(int)
        self.wall_ns: dict[tuple[str, str], int] = defaultdict(int)
        self._children: list[list[int]] = []  # per open phase: [child cpu ns, child wall ns]
        self._gc_start: tuple[int, int] = (0, 0)
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, event: str, info: dict[str, int]) -> None:
        if event == "start":
            self._gc_start = (time.process_time_ns(), time.perf_counter_ns())
            return
        cpu, wall = time.process_time_ns() - self._gc_start[0], time.perf_counter_ns() - self._gc_start[1]
        self.cpu_ns[(self.current, "gc")] += cpu
        self.wall_ns[(self.current, "gc")] += wall
        if self._children:
            self._children[-1][0] += cpu
            self._children[-1][1] += wall

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.sync is not None:
                self.sync()
            cpu0, wall0 = time.process_time_ns(), time.perf_counter_ns()
            self._children.append([0, 0])
            try:
                return fn(*args, **kwargs)
            finally:
                if self.sync is not None:
                    self.sync()
                cpu, wall = time.process_time_ns() - cpu0, time.perf_counter_ns() - wall0
                child_cpu, child_wall = self._children.pop()
                key = (self.current, phase)
                self.cpu_ns[key] += cpu - child_cpu
                self.wall_ns[key] += wall - child_wall
                if self._children:
                    self._children[-1][0] += cpu
                    self._children[-1][1] += wall
        return timed

    def take(self, runner: str) -> tuple[dict[str, int], dict[str, int]]:
        """(cpu ns, wall ns) per phase of `runner` since the last take, and reset them."""
        keys = [key for key in self.cpu_ns if key[0] == runner]
        cpu = {key[1]: self.cpu_ns.pop(key) for key in keys}
        wall = {key[1]: self.wall_ns.pop(key) for key in keys}
        return cpu, wall


_MODULE_PHASES: tuple[tuple[Any, str, str], ...] = (
    (model_runner_module, "apply_scheduler_output", "apply_scheduler_output"),
    (model_runner_module, "prepare_host_batch", "prepare_host_batch"),
    (spec_decoder_module, "prepare_host_batch", "prepare_host_batch"),
    (model_runner_module, "build_sampling_batch", "sampling_batch"),
    (spec_decoder_module, "build_sampling_batch", "sampling_batch"),
    (ngram_module, "propose_ngram_drafts", "ngram_lookup"),
)
"""(module, global, phase): functions the runner and the speculative step call through a module global."""


def instrument_modules(clock: PhaseClock) -> None:
    """Wrap the module-level phases once (both runners of the process share them)."""
    for module, name, phase in _MODULE_PHASES:
        if hasattr(module, name):
            setattr(module, name, clock.wrap(phase, getattr(module, name)))


def instrument_runner(runner: ModelRunner, clock: PhaseClock) -> None:
    """Wrap this runner's own phases: execute, forward, LM head, sampler, collect, and the proposer."""
    runner.execute = clock.wrap("execute", runner.execute)  # type: ignore[method-assign]
    runner.collect = clock.wrap("collect", runner.collect)  # type: ignore[method-assign]
    runner._forward = clock.wrap("forward", runner._forward)  # type: ignore[method-assign]
    runner.sampler.sample = clock.wrap("sample", runner.sampler.sample)  # type: ignore[method-assign]
    # The LM head: compute_logits, and lm_head_logits where the runner hands the sampler bf16 logits
    # (compute_logits then calls it; exclusive times keep the two apart, both under one phase).
    heads = [name for name in ("compute_logits", "lm_head_logits") if hasattr(runner.model, name)]
    for name in heads:
        setattr(runner.model, name, clock.wrap("compute_logits", getattr(runner.model, name)))
    decoder = runner.spec_decoder
    if decoder is None:
        return
    field = "lm_head_logits" if hasattr(decoder.target, "lm_head_logits") else "compute_logits"
    decoder.target = dataclasses.replace(decoder.target, **{field: getattr(runner.model, field)})
    decoder.propose = clock.wrap("propose", decoder.propose)  # type: ignore[method-assign]
    proposer = decoder.proposer
    for name, phase in (("rows", "ngram_sync"), ("index", "ngram_sync")):
        holder = getattr(proposer, name, None)
        if holder is not None and hasattr(holder, "sync_many"):
            holder.sync_many = clock.wrap(phase, holder.sync_many)
