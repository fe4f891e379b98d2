"""Builders for scheduler tests: short requests, small schedulers, a manual clock, a step driver."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from conveyor.config import Batching, CacheConfig, SchedulerConfig, SchedulingPolicy, SpeculativeConfig
from conveyor.core.fake_runner import FakeModelRunner, FakeSpeculation
from conveyor.core.outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from conveyor.core.policies import make_scheduler as make_policy
from conveyor.core.scheduler import Scheduler
from conveyor.core.stats import SchedulerStats
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams

EOS = 2


@dataclass
class ManualClock:
    """A clock the test moves by hand."""

    now_s: float = 0.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def make_request(request_id: str = "r0", num_prompt_tokens: int = 8, max_tokens: int | None = 4,
                 prompt: list[int] | None = None, **kwargs: object) -> Request:
    """A request with prompt tokens 100, 101, ... (or `prompt`); extra kwargs go to SamplingParams or
    Request (arrival_s, priority, cache_salt, eos_token_id)."""
    request_fields = {k: kwargs.pop(k) for k in ("arrival_s", "priority", "cache_salt", "eos_token_id")
                      if k in kwargs}
    params = SamplingParams(max_tokens=max_tokens, **kwargs)  # type: ignore[arg-type]
    tokens = list(prompt) if prompt is not None else [100 + i for i in range(num_prompt_tokens)]
    request_fields.setdefault("arrival_s", 0.0)
    request_fields.setdefault("eos_token_id", EOS)
    return Request(request_id, tokens, params, **request_fields)  # type: ignore[arg-type]


def make_scheduler(num_blocks: int = 64, block_size: int = 4, clock: ManualClock | None = None,
                   **config: object) -> Scheduler:
    """A scheduler; `config` keys go to SchedulerConfig, CacheConfig (enable_prefix_caching) or, as
    `speculative_config`, to speculative decoding."""
    cache_fields = {k: config.pop(k) for k in ("enable_prefix_caching",) if k in config}
    speculative_config = config.pop("speculative_config", None)
    assert speculative_config is None or isinstance(speculative_config, SpeculativeConfig)
    defaults: dict[str, object] = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 64}
    defaults.update(config)
    if isinstance(defaults.get("policy"), str):
        defaults["policy"] = SchedulingPolicy(defaults["policy"])
    if isinstance(defaults.get("batching"), str):
        defaults["batching"] = Batching(defaults["batching"])
    scheduler_config = SchedulerConfig(**defaults)  # type: ignore[arg-type]
    cache_config = replace(CacheConfig(block_size=block_size), **cache_fields)  # type: ignore[arg-type]
    return make_policy(scheduler_config, cache_config, num_blocks, clock or ManualClock(), speculative_config)


@dataclass
class StepResult:
    scheduler_output: SchedulerOutput
    outputs: EngineCoreOutputs
    stats: SchedulerStats

    @property
    def finished(self) -> dict[str, EngineCoreOutput]:
        return {o.request_id: o for o in self.outputs if o.finished}


@dataclass
class Driver:
    """Runs schedule -> fake runner -> update, checking invariants after every half-step."""

    scheduler: Scheduler
    speculation: FakeSpeculation | None = None
    """The fake runner proposes and verifies drafts (the scheduler needs a speculative_config)."""
    runner: FakeModelRunner = field(init=False)
    history: list[StepResult] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.runner = FakeModelRunner(self.scheduler.block_size, check_kv=True, speculation=self.speculation)

    def step(self, sampled: dict[str, list[int]] | None = None) -> StepResult:
        """One step; `sampled` overrides the fake runner's tokens for the listed requests."""
        scheduler_output = self.scheduler.schedule()
        self.scheduler.check_invariants()
        runner_output = self.runner.execute(scheduler_output)
        if sampled:
            merged = dict(runner_output.sampled_token_ids)
            merged.update({k: v for k, v in sampled.items() if merged.get(k)})
            runner_output = ModelRunnerOutput(merged)
        outputs, stats = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.scheduler.check_invariants()
        result = StepResult(scheduler_output, outputs, stats)
        self.history.append(result)
        return result

    def run_until_done(self, max_steps: int = 10_000) -> dict[str, EngineCoreOutput]:
        finished: dict[str, EngineCoreOutput] = {}
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return finished
            finished.update(self.step().finished)
        raise AssertionError(f"requests still unfinished after {max_steps} steps")
