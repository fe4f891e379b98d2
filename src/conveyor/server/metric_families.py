"""The Prometheus families /metrics exports: vLLM 0.32's `vllm:` set (names, types, labels, buckets) and
conveyor's own `conveyor:` ones, declared in one registry with their children created up front.

vLLM's PrometheusStatLogger (vllm/v1/metrics/loggers.py) is the model: every per-engine family carries
the labels `model_name` and `engine` (the engine-core index; conveyor runs one core, engine="0"),
`vllm:admission_rejections` carries `model_name` and `reason` only (it is a front-end count), and every
labelled child exists from the start so dashboards see zeros rather than no series. Buckets are vLLM's
(vllm/v1/metrics/buckets.py); the token-count histograms use the 1-2-5 series up to max_model_len.
Families vLLM has but that conveyor can never move (KV connector, multi-modal cache, `--enable-mfu-metrics`
estimates, sleep levels) are exported at their idle values, as vLLM exports them without those features.
Counters are declared without `_total`: prometheus_client appends it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from conveyor.request import FinishReason
from conveyor.server.errors import RejectReason

ENGINE_INDEX = "0"
"""The `engine` label: conveyor serves with exactly one engine core."""
LABELS = ("model_name", "engine")
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                             60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINE_QUEUE_TIME_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0,
                             2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 480.0, 1920.0, 7680.0)
"""conveyor:request_queue_time_seconds: vLLM's lowest queue-time bucket (0.3 s) holds every queue time
of an unloaded server; these resolve down to half a millisecond."""
TOKENIZATION_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                          2.5, 5.0, 10.0)
WAITING_REASONS = ("capacity", "deferred")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHED_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
"""vLLM 0.32's finished_reason values; conveyor adds `queue_timeout` (FinishReason.QUEUE_TIMEOUT)."""
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


@dataclass(frozen=True)
class FamilyMaker:
    """Declares families in one registry and returns the children of this server's label values."""

    registry: CollectorRegistry
    """Where every family is registered."""
    model_name: str
    """The served model name (label `model_name`)."""

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, LABELS, registry=self.registry,
                     multiprocess_mode="mostrecent").labels(self.model_name, ENGINE_INDEX)

    def counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, LABELS, registry=self.registry).labels(self.model_name, ENGINE_INDEX)

    def histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry).labels(
            self.model_name, ENGINE_INDEX)

    def gauges_by(self, name: str, doc: str, label: str, values: Sequence[str]) -> dict[str, Gauge]:
        gauge = Gauge(name, doc, LABELS + (label,), registry=self.registry, multiprocess_mode="mostrecent")
        return {value: gauge.labels(self.model_name, ENGINE_INDEX, value) for value in values}

    def counters_by(self, name: str, doc: str, label: str, values: Sequence[str],
                    labels: tuple[str, ...] = LABELS) -> dict[str, Counter]:
        """One child per value of `label`; `labels` are the family's other labels (LABELS or model_name)."""
        counter = Counter(name, doc, labels + (label,), registry=self.registry)
        prefix = (self.model_name, ENGINE_INDEX)[:len(labels)]
        return {value: counter.labels(*prefix, value) for value in values}


class SchedulerFamilies:
    """The engine's state (gauges) and per-step counts (counters), vLLM's names."""

    def __init__(self, make: FamilyMaker) -> None:
        self.running = make.gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = make.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.waiting_by_reason = make.gauges_by(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. 'capacity' = waiting for scheduling capacity; 'deferred' = "
            "deferred by transient constraints (never, in conveyor). Sum equals vllm:num_requests_waiting.",
            "reason", WAITING_REASONS)
        self.sleep_state = make.gauges_by(
            "vllm:engine_sleep_state", "Engine sleep state; awake = 1 means the engine is awake (conveyor "
            "never sleeps).", "sleep_state", SLEEP_STATES)
        self.sleep_state["awake"].set(1)
        self.kv_usage = make.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_cache_usage = make.gauge(
            "vllm:gpu_cache_usage_perc", "GPU KV-cache usage (vLLM's pre-V1 name, still plotted by vLLM's "
            "Grafana dashboard). DEPRECATED: Use vllm:kv_cache_usage_perc instead.")
        self.prefix_queries = make.counter("vllm:prefix_cache_queries",
                                           "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = make.counter("vllm:prefix_cache_hits",
                                        "Prefix cache hits, in terms of number of cached tokens.")
        self.external_queries = make.counter("vllm:external_prefix_cache_queries",
                                             "External prefix cache queries from KV connector (none in conveyor).")
        self.external_hits = make.counter("vllm:external_prefix_cache_hits",
                                          "External prefix cache hits from KV connector (none in conveyor).")
        self.mm_queries = make.counter("vllm:mm_cache_queries", "Multi-modal cache queries (text-only: none).")
        self.mm_hits = make.counter("vllm:mm_cache_hits", "Multi-modal cache hits (text-only: none).")
        self.preemptions = make.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.generation_tokens = make.counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.cached_by_source = make.counters_by(
            "vllm:prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the cache tier that supplied "
            "them (conveyor's only tier is device).", "source", CACHED_SOURCES)
        self.iteration_tokens = make.histogram("vllm:iteration_tokens_total",
                                               "Histogram of number of tokens per engine_step.",
                                               ITERATION_TOKENS_BUCKETS)
        self.flops = make.counter("vllm:estimated_flops_per_gpu", "Estimated number of floating point "
                                  "operations per GPU (only with --enable-mfu-metrics, which conveyor ignores).")
        self.read_bytes = make.counter("vllm:estimated_read_bytes_per_gpu", "Estimated number of bytes read "
                                       "from memory per GPU (only with --enable-mfu-metrics: ignored).")
        self.write_bytes = make.counter("vllm:estimated_write_bytes_per_gpu", "Estimated number of bytes "
                                        "written to memory per GPU (only with --enable-mfu-metrics: ignored).")


class RequestFamilies:
    """Per-request counts and intervals, observed when a request finishes (vLLM's names and buckets)."""

    def __init__(self, make: FamilyMaker, max_model_len: int) -> None:
        tokens = build_1_2_5_buckets(max_model_len)
        latency, h = REQUEST_LATENCY_BUCKETS_S, make.histogram
        self.prompt_tokens = make.counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_by_source = make.counters_by("vllm:prompt_tokens_by_source", "Number of prompt tokens by "
                                                 "source.", "source", PROMPT_SOURCES)
        self.prompt_cached = make.counter("vllm:prompt_tokens_cached",
                                          "Number of cached prompt tokens (local + external).")
        reasons = list(VLLM_FINISH_REASONS) + [FinishReason.QUEUE_TIMEOUT.value]
        self.success = make.counters_by("vllm:request_success", "Count of successfully processed requests.",
                                        "finished_reason", reasons)
        self.request_prompt_tokens = h("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = h("vllm:request_generation_tokens",
                                           "Number of generation tokens processed.", tokens)
        self.max_generation_tokens = h("vllm:request_max_num_generation_tokens",
                                       "Histogram of maximum number of requested generation tokens.", tokens)
        self.params_n = h("vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS)
        self.params_max_tokens = h("vllm:request_params_max_tokens",
                                   "Histogram of the max_tokens request parameter.", tokens)
        self.ttft = h("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                      TTFT_BUCKETS_S)
        self.itl = h("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                     ITL_BUCKETS_S)
        self.tpot = h("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds "
                      "(= inter-token latency; vLLM's Grafana dashboard still plots it). DEPRECATED: Use "
                      "vllm:inter_token_latency_seconds instead.", ITL_BUCKETS_S)
        self.request_tpot = h("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS_S)
        self.e2e = h("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", latency)
        self.queue_time = h("vllm:request_queue_time_seconds",
                            "Histogram of time spent in WAITING phase for request.", latency)
        self.inference_time = h("vllm:request_inference_time_seconds",
                                "Histogram of time spent in RUNNING phase for request.", latency)
        self.prefill_time = h("vllm:request_prefill_time_seconds",
                              "Histogram of time spent in PREFILL phase for request.", latency)
        self.decode_time = h("vllm:request_decode_time_seconds",
                             "Histogram of time spent in DECODE phase for request.", latency)
        self.num_preemptions = h("vllm:request_num_preemptions",
                                 "Histogram of the number of times a request was preempted.",
                                 REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.prefill_kv_computed = h("vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens "
                                     "computed during prefill (excluding cached tokens).", tokens)
        self.fine_queue_time = h("conveyor:request_queue_time_seconds", "Time spent in WAITING phase, with "
                                 "buckets below vLLM's lowest (0.3 s).", FINE_QUEUE_TIME_BUCKETS_S)


class FrontEndFamilies:
    """What the API server alone sees: refusals, admission caps, tokenization time, queue timeouts."""

    def __init__(self, make: FamilyMaker) -> None:
        self.rejected = make.counters_by("conveyor:requests_rejected", "Requests refused before generation, "
                                         "by reason.", "reason", [reason.value for reason in RejectReason],
                                         labels=("model_name",))
        self.admission = make.counters_by("vllm:admission_rejections", "Number of admission attempts rejected "
                                          "by a queue limit, by reason.", "reason",
                                          [reason.value for reason in ADMISSION_REASONS], labels=("model_name",))
        self.queue_timeouts = make.counter("conveyor:queue_timeouts",
                                           "Requests ended because they waited longer than --queue-timeout.")
        self.tokenization_time = make.histogram(
            "conveyor:tokenization_time_seconds",
            "Time the API server spent tokenizing (and templating) one request's prompt.", TOKENIZATION_BUCKETS_S)
        self.peak_memory = make.gauge(
            "conveyor:gpu_memory_peak_bytes", "Peak device memory of the engine-core process: "
            "torch.cuda.max_memory_reserved on CUDA, the process's peak resident set size (ru_maxrss) on CPU.")
