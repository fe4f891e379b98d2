"""Engine statistics -> Prometheus, under vLLM V1's names, types, `model_name` label and buckets.

Grafana dashboards written for vLLM must work unchanged, so names and buckets follow
vllm/v1/metrics/loggers.py. Each server owns its `CollectorRegistry` (no global state: several apps
can live in one test process). Fed by the engine client's stats listener, once per engine step with
news for this front end (on the event loop):

- gauges (running, waiting, KV usage) are the engine's state after the step; per-step counts go to
  counters; both come from the step's `SchedulerStats`, which exactly one front end receives;
- per-request intervals are observed when the request finishes, by the front end that served it,
  with vLLM's definitions: queue = first_scheduled - arrival, prefill = first_token - first_scheduled,
  decode = last_token - first_token, TTFT = first_token - arrival, ITL = gaps between consecutive
  token times, E2E = finished - arrival, inference = last_token - first_scheduled;
- the deprecated `vllm:gpu_cache_usage_perc` and `vllm:time_per_output_token_seconds` (= ITL, as vLLM V1
  observes it) are kept because vLLM's example Grafana dashboard still plots them;
- `vllm:prompt_tokens_total` counts a request's whole prompt (cache hits included, recomputation
  after preemption not) once it has produced a token, as vLLM does; we add it when it finishes;
- `vllm:admission_rejections_total{reason}` counts the 503s of the two admission caps, as vLLM 0.32.

With `--api-server-count N > 1` every front end writes into prometheus_client's multiprocess files
(`multiprocess_dir`) and any of them renders the merged view: counters and histograms are summed
over the front ends (each counted its own requests, and the engine's per-step counts reached one of
them only), gauges take the most recently written value (only the stats front end writes them), so
nothing is counted twice. Counters are declared without `_total`: prometheus_client appends it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

from conveyor.engine.types import EngineInfo, FinishedRequestStats, IterationStats, SchedulerStats
from conveyor.request import FinishReason
from conveyor.server.errors import RejectReason
from conveyor.server.spec_metrics import SpecDecodeMetrics

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                             60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TOKENIZATION_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                          2.5, 5.0, 10.0)
LABELS = ("model_name",)
ADMISSION_REASONS = (RejectReason.MAX_NUM_QUEUED_REQS, RejectReason.MAX_NUM_QUEUED_TOKENS)
"""The rejections vLLM counts in vllm:admission_rejections_total (the two queue caps)."""


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def _label_name(key: str) -> str:
    """A config key such as `max-num-seqs` as a valid Prometheus label name."""
    name = re.sub(r"[^a-zA-Z0-9_]", "_", key)
    return name if re.match(r"[a-zA-Z_]", name) else f"_{name}"


class ServerMetrics:
    """The server's Prometheus registry and the listener that feeds it."""

    def __init__(self, info: EngineInfo, multiprocess_dir: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = info.model_name
        self._multiprocess_dir = multiprocess_dir
        """prometheus_client's multiprocess directory when several front ends share the metrics."""
        self._make_gauges_and_counters()
        self._make_histograms(info.max_model_len)
        self._make_conveyor_metrics(info)
        k = info.num_speculative_tokens  # vLLM's vllm:spec_decode_* counters exist only with speculation
        self.spec_decode = SpecDecodeMetrics(self.registry, self.model_name, k) if k else None

    # Each helper returns the child for this server's model_name (the only label vLLM's dashboards need).
    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, LABELS, registry=self.registry, multiprocess_mode="mostrecent").labels(self.model_name)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, LABELS, registry=self.registry).labels(self.model_name)

    def _counters_by(self, name: str, doc: str, label: str, values: list[str]) -> dict[str, Counter]:
        """One child per label value, created up front so every series exists from the start (as vLLM)."""
        counter = Counter(name, doc, LABELS + (label,), registry=self.registry)
        return {value: counter.labels(self.model_name, value) for value in values}

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry).labels(self.model_name)

    def _make_gauges_and_counters(self) -> None:
        self.running = self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        # Deprecated vLLM names that vLLM's example Grafana dashboard still plots: same values.
        self.gpu_cache_usage = self._gauge("vllm:gpu_cache_usage_perc",
                                           "GPU KV-cache usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.")
        self.preemptions = self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_queries = self._counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = self._counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = self._counters_by("vllm:request_success", "Count of successfully processed requests.",
                                    "finished_reason", [reason.value for reason in FinishReason])
        self.success = {reason: success[reason.value] for reason in FinishReason}

    def _make_histograms(self, max_model_len: int) -> None:
        token_buckets = build_1_2_5_buckets(max_model_len)
        latency = REQUEST_LATENCY_BUCKETS_S
        h = self._histogram
        self.ttft = h("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                      TTFT_BUCKETS_S)
        self.itl = h("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                     ITL_BUCKETS_S)
        self.tpot = h("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds. "
                      "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", ITL_BUCKETS_S)
        self.inference_time = h("vllm:request_inference_time_seconds",
                                "Histogram of time spent in RUNNING phase for request.", latency)
        self.e2e = h("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", latency)
        self.queue_time = h("vllm:request_queue_time_seconds",
                            "Histogram of time spent in WAITING phase for request.", latency)
        self.prefill_time = h("vllm:request_prefill_time_seconds",
                              "Histogram of time spent in PREFILL phase for request.", latency)
        self.decode_time = h("vllm:request_decode_time_seconds",
                             "Histogram of time spent in DECODE phase for request.", latency)
        self.iteration_tokens = h("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                  ITERATION_TOKENS_BUCKETS)
        self.request_prompt_tokens = h("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                       token_buckets)
        self.request_generation_tokens = h("vllm:request_generation_tokens",
                                           "Number of generation tokens processed.", token_buckets)

    def _make_conveyor_metrics(self, info: EngineInfo) -> None:
        rejected = self._counters_by("conveyor:requests_rejected", "Requests refused before generation, by reason.",
                                     "reason", [reason.value for reason in RejectReason])
        self.rejected = {reason: rejected[reason.value] for reason in RejectReason}
        admission = self._counters_by("vllm:admission_rejections",
                                      "Number of admission attempts rejected by a queue limit, by reason.",
                                      "reason", [reason.value for reason in ADMISSION_REASONS])
        self.admission_rejections = {reason: admission[reason.value] for reason in ADMISSION_REASONS}
        self.queue_timeouts = self._counter("conveyor:queue_timeouts",
                                            "Requests ended because they waited longer than --queue-timeout.")
        self.tokenization_time = self._histogram(
            "conveyor:request_tokenization_time_seconds",
            "Time the API server spent tokenizing (and templating) one request's prompt.", TOKENIZATION_BUCKETS_S)
        self._peak_memory = Gauge("conveyor:engine_peak_memory_bytes",
                                  "Peak GPU memory reserved by the engine-core process "
                                  "(torch.cuda.max_memory_reserved; absent on CPU).",
                                  LABELS, registry=self.registry, multiprocess_mode="mostrecent")
        config = {_label_name(key): value for key, value in sorted(info.config.items())}
        config.update(max_model_len=str(info.max_model_len), block_size=str(info.block_size),
                      num_kv_blocks=str(info.num_kv_blocks))
        config.pop("model_name", None)
        gauge = Gauge("conveyor:config_info", "Resolved engine configuration (value is always 1).",
                      LABELS + tuple(config), registry=self.registry, multiprocess_mode="max")
        gauge.labels(model_name=self.model_name, **config).set(1)

    def on_step(self, iteration: IterationStats) -> None:
        """The engine client's stats listener (event loop)."""
        if iteration.scheduler is not None:
            self._observe_engine(iteration.scheduler)
        if iteration.peak_memory_bytes is not None:
            self._peak_memory.labels(self.model_name).set(iteration.peak_memory_bytes)
        for request in iteration.finished:
            self._observe_finished(request)

    def _observe_engine(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        self.kv_usage.set(stats.kv_cache_usage)
        self.gpu_cache_usage.set(stats.kv_cache_usage)
        self.preemptions.inc(stats.num_preemptions)
        self.prefix_queries.inc(stats.prefix_cache_queries)
        self.prefix_hits.inc(stats.prefix_cache_hits)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.queue_timeouts.inc(stats.num_queue_timeouts)
        if stats.num_scheduled_tokens > 0:
            self.iteration_tokens.observe(stats.num_scheduled_tokens)
        if self.spec_decode is not None:
            self.spec_decode.observe(stats)

    def _observe_finished(self, request: FinishedRequestStats) -> None:
        self.success[request.finish_reason].inc()
        t = request.timings
        if t.finished_s is not None:
            self.e2e.observe(t.finished_s - t.arrival_s)
        if t.first_scheduled_s is not None:
            self.queue_time.observe(t.first_scheduled_s - t.arrival_s)
        self.request_prompt_tokens.observe(request.num_prompt_tokens)
        self.request_generation_tokens.observe(request.num_generation_tokens)
        if t.first_token_s is None:
            return  # never produced a token: no TTFT, prefill or decode interval
        self.prompt_tokens.inc(request.num_prompt_tokens)
        self.ttft.observe(t.first_token_s - t.arrival_s)
        if t.first_scheduled_s is not None:
            self.prefill_time.observe(t.first_token_s - t.first_scheduled_s)
        if t.last_token_s is not None:
            self.decode_time.observe(t.last_token_s - t.first_token_s)
            if t.first_scheduled_s is not None:
                self.inference_time.observe(t.last_token_s - t.first_scheduled_s)
        for earlier, later in zip(t.token_times_s, t.token_times_s[1:]):
            self.itl.observe(later - earlier)
            self.tpot.observe(later - earlier)

    def count_rejection(self, reason: RejectReason) -> None:
        self.rejected[reason].inc()
        if reason in self.admission_rejections:
            self.admission_rejections[reason].inc()

    def observe_tokenization(self, seconds: float) -> None:
        self.tokenization_time.observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition: this registry, or every front end's merged (multiprocess)."""
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged, path=self._multiprocess_dir)
        return generate_latest(merged)
