"""Engine statistics -> Prometheus, as vLLM 0.32 exports them (server/metric_families.py declares them).

Each server owns its `CollectorRegistry` (no global state: several apps can live in one test process),
with the process, platform and GC collectors vLLM's default registry has. Fed by the engine client's
stats listener, once per engine step with news for this front end (on the event loop):

- gauges (running, waiting, KV usage) are the engine's state after the step; per-step counts go to
  counters; both come from the step's `SchedulerStats`, which exactly one front end receives;
- per-request numbers are observed when the request finishes, by the front end that served it, with
  vLLM's definitions: queue = first_scheduled - arrival, prefill = first_token - first_scheduled,
  decode = last_token - first_token, TTFT = first_token - arrival, ITL = gaps between consecutive token
  times, E2E = finished - arrival, inference = last_token - first_scheduled, per-request TPOT =
  decode / (generated - 1) (0 for one token), prefill KV computed = prompt - cached;
- `vllm:prompt_tokens_total` (and `_by_source`, `_cached`) count a request's whole prompt once it has
  produced a token, as vLLM does (cache hits included, recomputation after preemption not);
- `vllm:request_params_n` and `vllm:request_max_num_generation_tokens` are observed once per API request
  when its last choice ends, `vllm:request_params_max_tokens` once per choice (vLLM's parallel sampling);
- the deprecated `vllm:gpu_cache_usage_perc` and `vllm:time_per_output_token_seconds` (= ITL, as vLLM V1
  observed it) are kept because vLLM's Grafana dashboard still plots them.

With `--api-server-count N > 1` every front end writes into prometheus_client's multiprocess files
(`multiprocess_dir`) and any of them renders the merged view: counters and histograms are summed over
the front ends (each counted its own requests, and the engine's per-step counts reached one of them
only), gauges take the most recently written value (only the stats front end writes them), so nothing
is counted twice; the GPU and process collectors are the rendering process's own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge, generate_latest, multiprocess
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from conveyor.engine.types import EngineInfo, FinishedRequestStats, GenerateRequest, IterationStats, SchedulerStats
from conveyor.server.cache_info import add_cache_config_info
from conveyor.server.errors import RejectReason
from conveyor.server.host_metrics import GpuCollector, ModelInfoPublisher, Nvml
from conveyor.server.metric_families import (
    FamilyMaker,
    FrontEndFamilies,
    RequestFamilies,
    SchedulerFamilies,
    build_1_2_5_buckets,
)
from conveyor.server.spec_metrics import SpecDecodeMetrics

__all__ = ["ServerMetrics", "build_1_2_5_buckets"]


def _label_name(key: str) -> str:
    """A config key such as `max-num-seqs` as a valid Prometheus label name."""
    name = re.sub(r"[^a-zA-Z0-9_]", "_", key)
    return name if re.match(r"[a-zA-Z_]", name) else f"_{name}"


@dataclass
class _ParentRequest:
    """An API request's n choices, until the last one ends (for request_params_n and max generation)."""

    n: int
    remaining: int
    max_generation_tokens: int = 0


class ServerMetrics:
    """The server's Prometheus registry and the listener that feeds it."""

    def __init__(self, info: EngineInfo, multiprocess_dir: str | None = None, nvml: Nvml | None = None) -> None:
        """`nvml`: where GPU readings come from (tests give their own; default: pynvml where installed)."""
        self.registry = CollectorRegistry()
        self.model_name = info.model_name
        self._max_model_len = info.max_model_len
        self._multiprocess_dir = multiprocess_dir
        """prometheus_client's multiprocess directory when several front ends share the metrics."""
        make = FamilyMaker(self.registry, info.model_name)
        self.scheduler = SchedulerFamilies(make)
        self.requests = RequestFamilies(make, info.max_model_len)
        self.front = FrontEndFamilies(make)
        self._parents: dict[str, _ParentRequest] = {}
        """Engine request id -> its API request, while any of that request's choices runs."""
        add_cache_config_info(self.registry, info)
        self._add_config_info(info)
        self.model_info = ModelInfoPublisher(self.registry, info)
        self._gpu = GpuCollector(info, nvml or Nvml())
        if multiprocess_dir is None:
            self._add_local_collectors(self.registry)
        k = info.num_speculative_tokens  # vLLM's vllm:spec_decode_* counters exist only with speculation
        self.spec_decode = SpecDecodeMetrics(self.registry, self.model_name, k) if k else None

    def _add_local_collectors(self, registry: CollectorRegistry) -> None:
        """What this process reports of itself and its host (read at scrape time, never merged)."""
        registry.register(self._gpu)
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)

    def _add_config_info(self, info: EngineInfo) -> None:
        config = {_label_name(key): value for key, value in sorted(info.config.items())}
        config.update(max_model_len=str(info.max_model_len), block_size=str(info.block_size),
                      num_kv_blocks=str(info.num_kv_blocks))
        config.pop("model_name", None)
        gauge = Gauge("conveyor:config_info", "Resolved engine configuration (value is always 1).",
                      ("model_name",) + tuple(config), registry=self.registry, multiprocess_mode="max")
        gauge.labels(model_name=self.model_name, **config).set(1)

    def start(self) -> None:
        """Start the background work (the model's file digests); called once the server starts."""
        self.model_info.start()

    def track_request(self, requests: list[GenerateRequest]) -> None:
        """An API request was admitted as these engine requests (its n choices)."""
        parent = _ParentRequest(n=len(requests), remaining=len(requests))
        for request in requests:
            self._parents[request.request_id] = parent
            max_tokens = request.sampling_params.max_tokens
            # vLLM resolves an absent max_tokens to what is left of the context before it observes it
            resolved = max_tokens if max_tokens is not None else self._max_model_len - len(request.prompt_token_ids)
            self.requests.params_max_tokens.observe(resolved)

    def on_step(self, iteration: IterationStats) -> None:
        """The engine client's stats listener (event loop)."""
        if iteration.scheduler is not None:
            self._observe_engine(iteration.scheduler)
        if iteration.peak_memory_bytes is not None:
            self.front.peak_memory.set(iteration.peak_memory_bytes)
        for request in iteration.finished:
            self._observe_finished(request)
            self._observe_parent(request)

    def _observe_engine(self, stats: SchedulerStats) -> None:
        s = self.scheduler
        s.running.set(stats.num_running_reqs)
        s.waiting.set(stats.num_waiting_reqs)
        s.waiting_by_reason["capacity"].set(stats.num_waiting_reqs)
        s.kv_usage.set(stats.kv_cache_usage)
        s.gpu_cache_usage.set(stats.kv_cache_usage)
        s.preemptions.inc(stats.num_preemptions)
        s.prefix_queries.inc(stats.prefix_cache_queries)
        s.prefix_hits.inc(stats.prefix_cache_hits)
        s.cached_by_source["device"].inc(stats.prefix_cache_hits)
        s.generation_tokens.inc(stats.num_generation_tokens)
        self.front.queue_timeouts.inc(stats.num_queue_timeouts)
        if stats.num_scheduled_tokens > 0:
            s.iteration_tokens.observe(stats.num_scheduled_tokens)
        if self.spec_decode is not None:
            self.spec_decode.observe(stats)

    def _observe_finished(self, request: FinishedRequestStats) -> None:
        r, t = self.requests, request.timings
        r.success[request.finish_reason.value].inc()
        if t.finished_s is not None:
            r.e2e.observe(t.finished_s - t.arrival_s)
        if t.first_scheduled_s is not None:
            r.queue_time.observe(t.first_scheduled_s - t.arrival_s)
            r.fine_queue_time.observe(t.first_scheduled_s - t.arrival_s)
        r.request_prompt_tokens.observe(request.num_prompt_tokens)
        r.request_generation_tokens.observe(request.num_generation_tokens)
        r.num_preemptions.observe(request.num_preemptions)
        r.prefill_kv_computed.observe(request.num_prompt_tokens - max(request.num_cached_tokens, 0))
        if t.first_token_s is None:
            return  # never produced a token: no TTFT, prefill or decode interval
        self._observe_prompt(request)
        r.ttft.observe(t.first_token_s - t.arrival_s)
        if t.first_scheduled_s is not None:
            r.prefill_time.observe(t.first_token_s - t.first_scheduled_s)
        if t.last_token_s is not None:
            decode = t.last_token_s - t.first_token_s
            r.decode_time.observe(decode)
            r.request_tpot.observe(decode / (request.num_generation_tokens - 1)
                                   if request.num_generation_tokens > 1 else 0.0)
            if t.first_scheduled_s is not None:
                r.inference_time.observe(t.last_token_s - t.first_scheduled_s)
        for earlier, later in zip(t.token_times_s, t.token_times_s[1:]):
            r.itl.observe(later - earlier)
            r.tpot.observe(later - earlier)

    def _observe_prompt(self, request: FinishedRequestStats) -> None:
        r = self.requests
        cached = min(max(request.num_cached_tokens, 0), request.num_prompt_tokens)
        r.prompt_tokens.inc(request.num_prompt_tokens)
        r.prompt_cached.inc(cached)
        r.prompt_by_source["local_compute"].inc(request.num_prompt_tokens - cached)
        r.prompt_by_source["local_cache_hit"].inc(cached)

    def _observe_parent(self, request: FinishedRequestStats) -> None:
        parent = self._parents.pop(request.request_id, None)
        if parent is None:
            return  # an engine request no API request tracked (offline callers, tests)
        parent.remaining -= 1
        parent.max_generation_tokens = max(parent.max_generation_tokens, request.num_generation_tokens)
        if parent.remaining == 0:
            self.requests.params_n.observe(parent.n)
            self.requests.max_generation_tokens.observe(parent.max_generation_tokens)

    def count_rejection(self, reason: RejectReason) -> None:
        self.front.rejected[reason.value].inc()
        if reason.value in self.front.admission:
            self.front.admission[reason.value].inc()

    def observe_tokenization(self, seconds: float) -> None:
        self.front.tokenization_time.observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition: this registry, or every front end's merged (multiprocess)."""
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged, path=self._multiprocess_dir)
        self._add_local_collectors(merged)
        return generate_latest(merged)
