"""Offline generation: `LLM(...).generate(prompts, sampling_params)` → one result per prompt, in order.

All prompts are submitted at once and the step loop runs until every request has finished, so the
batch policy (continuous, or static with `batching="static"`) decides the interleaving, exactly as
in the server. Keyword arguments name config fields (`max_num_seqs=8`, `enable_prefix_caching=False`,
`batching="static"`, `kv_cache_memory_bytes=...`, and as vLLM `speculative_config={"method": "ngram",
"num_speculative_tokens": 3}`) or pass a whole `engine_config=`.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from conveyor.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from conveyor.core.lifecycle import KVPoolSize, with_eos_stop_ids
from conveyor.core.stats import SchedulerStats, SpecDecodingStats
from conveyor.engine.admission import AdmissionControl, QueueLimits, RequestLimits, check_request
from conveyor.engine.grammar_check import compile_check
from conveyor.engine.async_tokenizer import TextTokenizer
from conveyor.engine.engine_core import EngineCore
from conveyor.engine.generation_defaults import default_sampling_params, override_items, sampling_defaults_of
from conveyor.engine.output_processor import OutputProcessor, ProcessedOutputs
from conveyor.engine.types import EngineOverloadedError, FinishedRequestStats, RequestOutput
from conveyor.request import FinishReason, Request, RequestTimings
from conveyor.sampling_params import SamplingParams

Prompt = str | list[int] | Mapping[str, object]
"""Text, token ids, or vLLM's prompt dict: {"prompt": text} or {"prompt_token_ids": ids}, with an
optional "cache_salt" (the request's prefix-cache namespace, as the server's field)."""
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})

_SECTIONS: dict[str, type] = {"model": ModelConfig, "scheduler": SchedulerConfig, "cache": CacheConfig,
                              "device": DeviceConfig}
_VLLM_NAMES = {"kv_cache_dtype": "cache_dtype"}
"""vLLM's LLM() keyword -> the config field it sets, where the two differ (the CLI flag is vLLM's too)."""


@dataclass(frozen=True)
class CompletionResult:
    """One finished request."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stop_reason: int | str | None
    timings: RequestTimings
    """Arrival, first scheduled, first/last token, finished (monotonic seconds)."""
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error_message: str | None = None


@dataclass
class RunSummary:
    """What the last `generate` call did, step by step (for tests and benchmarks)."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_generation_tokens: int = 0
    elapsed_s: float = 0.0
    max_kv_cache_usage: float = 0.0
    max_num_running: int = 0
    spec_decoding: SpecDecodingStats | None = None
    """Speculative decoding's counters summed over the run (None: no step verified drafts)."""

    def add(self, stats: SchedulerStats) -> None:
        if stats.spec_decoding is not None:
            self.spec_decoding = stats.spec_decoding.merged(self.spec_decoding)
        self.num_steps += 1
        self.num_preemptions += stats.num_preemptions
        self.num_generation_tokens += stats.num_generation_tokens
        self.max_kv_cache_usage = max(self.max_kv_cache_usage, stats.kv_cache_usage)
        self.max_num_running = max(self.max_num_running, stats.num_running_reqs)


@dataclass
class _Pending:
    """A request being collected."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    final: RequestOutput | None = None
    stats: FinishedRequestStats | None = None


def engine_config_from_kwargs(base: EngineConfig | None = None, **kwargs: object) -> EngineConfig:
    """`EngineConfig` with fields set by name; enum fields accept their string values."""
    config = base or EngineConfig()
    changes: dict[str, dict[str, object]] = {section: {} for section in _SECTIONS}
    top: dict[str, object] = {}
    for name, value in kwargs.items():
        name = _VLLM_NAMES.get(name, name)
        if name == "check_invariants":
            top[name] = bool(value)
            continue
        if name == "step_log_size":
            top[name] = int(value)  # type: ignore[call-overload]
            continue
        if name == "speculative_config":  # vLLM's LLM(speculative_config={...}): the CLI flag's JSON keys
            top[name] = SpeculativeConfig.from_dict(value) if isinstance(value, Mapping) else value
            continue
        if name == "override_generation_config" and isinstance(value, Mapping):  # vLLM's LLM takes a dict
            value = override_items(value)
        section = next((s for s, cls in _SECTIONS.items() if name in {f.name for f in dataclasses.fields(cls)}), None)
        if section is None:
            raise TypeError(f"LLM got an unknown engine argument {name!r}")
        old = getattr(getattr(config, section), name)
        changes[section][name] = type(old)(value) if isinstance(old, enum.Enum) and isinstance(value, str) else value
    sections = {s: dataclasses.replace(getattr(config, s), **c) for s, c in changes.items() if c}
    return dataclasses.replace(config, **sections, **top)


class LLM:
    """Load once, generate many times: the engine core runs in this process, no sockets.

    The same three pieces as the server, in one thread: the admission rule (`engine.admission`), the
    `EngineCore` step loop and the `OutputProcessor` (text, stop strings: a matched stop string is
    finished in the scheduler before the next step).
    """

    def __init__(self, model: str | None = None, *, engine_config: EngineConfig | None = None,
                 **kwargs: object) -> None:
        from conveyor.engine.model_files import tokenizer_path
        from conveyor.engine.model_setup import build_engine_core, core_side_config
        from conveyor.engine.tokenizer import Tokenizer

        if model is not None:
            kwargs["model"] = model
        config = engine_config_from_kwargs(engine_config, **kwargs)
        core = build_engine_core(core_side_config(config))
        self._setup(config, core, Tokenizer.from_path(tokenizer_path(core.config.model)))

    @classmethod
    def from_core(cls, core: EngineCore, tokenizer: TextTokenizer, config: EngineConfig | None = None) -> LLM:
        """Wrap an already built core (tests with fakes, shared runners); `config` keeps the caps."""
        llm = cls.__new__(cls)
        llm._setup(config or core.config, core, tokenizer)
        return llm

    def _setup(self, config: EngineConfig, core: EngineCore, tokenizer: TextTokenizer) -> None:
        self.config = config
        self.core = core
        self.tokenizer = tokenizer
        self.last_run = RunSummary()
        scheduler = config.scheduler
        self._limits = RequestLimits(dataclasses.replace(scheduler, max_model_len=core.limits.max_model_len),
                                     KVPoolSize(core.limits.num_kv_blocks, config.cache.block_size),
                                     core.limits.vocab_size, speculative=config.speculative_config is not None,
                                     tensor_parallel=config.parallel.tensor_parallel_size > 1)
        self._admission = AdmissionControl(QueueLimits(scheduler.max_num_queued_reqs, scheduler.max_num_queued_tokens))
        self._processor = OutputProcessor(tokenizer, scheduler.queue_timeout_s)
        self._eos = core.limits.eos
        self._id_prefix = uuid.uuid4().hex[:8]  # unique across LLMs sharing a runner
        self._next_id = 0
        self._default_params = default_sampling_params(sampling_defaults_of(config.model))

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the parameters of `generate(..., sampling_params=None)`, the model's generation-config
        defaults (--generation-config; none: SamplingParams())."""
        return self._default_params

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 show_progress: bool = False) -> list[CompletionResult]:
        """Generate for every prompt (text or token ids); results come back in input order.
        Raises RequestRejectedError (naming the field) before anything runs if a prompt cannot fit."""
        prompt_list, salts = _unpack_prompts(_as_prompt_list(prompts))
        params_list = _as_params_list(self._default_params if sampling_params is None else sampling_params,
                                      len(prompt_list))
        pending = []
        for prompt, params in zip(prompt_list, params_list):
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            check_request(token_ids, params, self._limits)
            if params.structured_output is not None:  # offline: no event loop to keep free
                compile_check(params.structured_output)
            pending.append(_Pending(self._new_id(), token_ids, params))
        for item, salt in zip(pending, salts):  # from vLLM's prompt dicts
            item.cache_salt = salt
        self._run(pending, show_progress)
        return [_result(p) for p in pending]

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's LLM.reset_prefix_cache: forget the prefix cache (between generate calls nothing runs,
        so it always succeeds then); returns whether it was reset."""
        return self.core.reset_prefix_cache(reset_running_requests)

    def _new_id(self) -> str:
        self._next_id += 1
        return f"{self._id_prefix}-{self._next_id - 1}"

    def _run(self, pending: list[_Pending], show_progress: bool) -> None:
        by_id = {p.request_id: p for p in pending}
        to_add = deque(pending)
        self.last_run = summary = RunSummary()
        start = time.monotonic()
        num_done = 0
        while to_add or self.core.has_unfinished_requests():
            self._admit(to_add)
            result = self.core.step()
            processed = self._processor.process(result.outputs)
            if processed.stop_string_request_ids:  # finish them before the next schedule()
                _merge(processed, self._processor.process(
                    self.core.abort(processed.stop_string_request_ids, FinishReason.STOP)))
            summary.add(result.stats)
            for finished in processed.finished_stats:
                self._admission.release(finished.request_id)
            num_done += _collect(by_id, processed.request_outputs, processed.finished_stats)
            if show_progress:
                print(f"\rconveyor: {num_done}/{len(pending)} requests done", end="", file=sys.stderr)
        summary.elapsed_s = time.monotonic() - start
        if show_progress:
            print(file=sys.stderr)

    def _admit(self, to_add: deque[_Pending]) -> None:
        """Submit as many as the in-flight caps allow; the rest wait here (nothing is dropped)."""
        while to_add:
            item = to_add[0]
            try:
                self._admission.admit(item.request_id, len(item.prompt_token_ids))
            except EngineOverloadedError:
                return
            to_add.popleft()
            now = time.monotonic()
            params = with_eos_stop_ids(item.params, self._eos)
            self.core.add_request(Request(item.request_id, item.prompt_token_ids, params, now,
                                          eos_token_id=self._eos.primary, cache_salt=item.cache_salt))
            self._processor.add_request(item.request_id, item.prompt_token_ids, item.params, now)


def _merge(target: ProcessedOutputs, extra: ProcessedOutputs) -> None:
    target.request_outputs.extend(extra.request_outputs)
    target.finished_stats.extend(extra.finished_stats)


def _collect(by_id: dict[str, _Pending], outputs: list[RequestOutput], stats: list[FinishedRequestStats]) -> int:
    num_finished = 0
    for output in outputs:
        item = by_id[output.request_id]
        item.text.append(output.new_text)
        item.token_ids.extend(output.new_token_ids)
        if output.finished:
            item.final = output
            num_finished += 1
    for finished in stats:
        by_id[finished.request_id].stats = finished
    return num_finished


def _result(item: _Pending) -> CompletionResult:
    final, stats = item.final, item.stats
    assert final is not None and final.finish_reason is not None, "every request ends with a final output"
    return CompletionResult(
        request_id=item.request_id,
        prompt_token_ids=item.prompt_token_ids,
        output_token_ids=item.token_ids,
        text="".join(item.text),
        finish_reason=final.finish_reason,
        stop_reason=final.stop_reason,
        timings=stats.timings if stats else RequestTimings(arrival_s=0.0),
        num_cached_tokens=stats.num_cached_tokens if stats else final.num_cached_tokens,
        num_preemptions=stats.num_preemptions if stats else 0,
        error_message=final.error_message,
    )


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [list(items)]  # a single prompt given as token ids
    return [p if isinstance(p, (str, Mapping)) else list(p) for p in items]


def _unpack_prompts(prompts: list[Prompt]) -> tuple[list[str | list[int]], list[str | None]]:
    """(texts or token ids, cache salts), one each per prompt."""
    unpacked = [_unpack_prompt(prompt) for prompt in prompts]
    return [prompt for prompt, _ in unpacked], [salt for _, salt in unpacked]


def _unpack_prompt(prompt: Prompt) -> tuple[str | list[int], str | None]:
    """(text or token ids, cache_salt); a prompt dict is checked as vLLM checks it (ValueError naming the key)."""
    if not isinstance(prompt, Mapping):
        return prompt, None
    if set(prompt) - _PROMPT_KEYS or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError(f"prompt: a dict needs 'prompt' or 'prompt_token_ids' (and optionally 'cache_salt'), "
                         f"got keys {sorted(prompt)}")
    salt = prompt.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("cache_salt: must be a non-empty string if provided")
    text = prompt.get("prompt")
    if isinstance(text, str):
        return text, salt
    ids = prompt.get("prompt_token_ids", text)
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise ValueError("prompt: 'prompt' must be a string and 'prompt_token_ids' a list of ints")
    return list(ids), salt


def _as_params_list(params: SamplingParams | Sequence[SamplingParams], num: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * num
    params_list = list(params)
    if len(params_list) != num:
        raise ValueError(f"sampling_params has {len(params_list)} entries for {num} prompts")
    return params_list
