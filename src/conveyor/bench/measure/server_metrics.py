"""Server-side view of a run: /metrics scraped before, during and after, reduced to run-level numbers.

Counters and histograms are cumulative since server start, so everything is a delta between the scrape
before the first request and the scrape after the last one: queue-time percentiles come from the delta
of the queue-time buckets (`conveyor:request_queue_time_seconds`, finer, when the server has it, else
vLLM's `vllm:request_queue_time_seconds`), preemptions and token counts from counter deltas, the
prefix-cache hit rate from hits/queries deltas, CPU tokenization time from
`conveyor:tokenization_time_seconds`, speculative decoding's acceptance from the `vllm:spec_decode_*`
counters (spec_metrics.py). A histogram percentile is the bucket holding it, with an interval
over requests (intervals.bucket_quantile); one in the lowest bucket is reported as "<= bound"
(`queue_time_p95_ms` null, `queue_time_p95_bucket_ms` [0, bound]), never interpolated. Gauges (running,
waiting, KV usage, GPU memory and utilisation) are sampled every scrape interval into a time series;
GPU memory and utilisation come from NVML when the server is on this host and pynvml is installed, else
from the server's `conveyor:gpu_*` gauges, else stay null (unknown, never invented). vLLM's V1 names are
read first, older vLLM names as fallbacks, so the same code measures conveyor and vLLM. A server without
/metrics gives available=false and every number null; the run stays valid. docs/decision.md lists every
name read.
"""

from __future__ import annotations

import asyncio
import importlib
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from conveyor.bench.measure.intervals import IntervalConfig, bucket_quantile
from conveyor.bench.measure.prom_text import Snapshot, bucket_delta
from conveyor.bench.measure.spec_metrics import SPEC_KEYS, spec_decode_summary

RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREEMPTIONS = ("vllm:num_preemptions_total", "vllm:num_preemptions")
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
GENERATION_TOKENS = ("vllm:generation_tokens_total",)
PROMPT_TOKENS = ("vllm:prompt_tokens_total",)
QUEUE_TIME = ("conveyor:request_queue_time_seconds", "vllm:request_queue_time_seconds")
TOKENIZATION_TIME = ("conveyor:tokenization_time_seconds",)
GPU_MEMORY = ("conveyor:gpu_memory_peak_bytes", "conveyor:gpu_memory_used_bytes")
GPU_UTILIZATION = ("conveyor:gpu_utilization_perc",)
CONFIG_INFO = ("conveyor:config_info", "vllm:cache_config_info")
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0"})


@dataclass
class Sample:
    """One sampled point of the gauges (a line of server_timeseries.jsonl before t is made relative)."""

    t_abs: float
    num_requests_running: float | None
    num_requests_waiting: float | None
    kv_cache_usage_perc: float | None
    gpu_utilization_perc: float | None = None


@dataclass
class ServerObservation:
    """Everything scraped over a run."""

    before: Snapshot | None = None
    after: Snapshot | None = None
    samples: list[Sample] = field(default_factory=list)
    peak_gpu_memory_bytes: float | None = None
    gpu_memory_source: str | None = None
    """"nvml" or "server" (None: not measured)."""


@dataclass(frozen=True)
class NvmlReading:
    """Local GPUs via NVML: used memory summed, utilisation averaged (0..1), names."""

    used_bytes: float
    utilization: float
    names: tuple[str, ...]


def nvml_reading() -> NvmlReading | None:
    """Read NVML, or None when pynvml or a GPU is missing (only meaningful for a server on this host)."""
    try:
        nvml: Any = importlib.import_module("pynvml")  # optional dependency
        nvml.nvmlInit()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        if not handles:
            return None
        used = sum(float(nvml.nvmlDeviceGetMemoryInfo(h).used) for h in handles)
        util = sum(float(nvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in handles) / (100.0 * len(handles))
        names = tuple(str(nvml.nvmlDeviceGetName(h)) for h in handles)
        return NvmlReading(used, util, names)
    except Exception:  # noqa: BLE001 - any NVML failure just means "not available"
        return None


class ServerScraper:
    """Scrapes /metrics of one server; run() samples gauges until cancelled."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, interval_s: float) -> None:
        self.session, self.base_url, self.interval_s = session, base_url.rstrip("/"), interval_s
        self.obs = ServerObservation()
        host = urllib.parse.urlsplit(base_url).hostname or ""
        self.local = host in LOCAL_HOSTS

    async def scrape(self) -> Snapshot | None:
        try:
            async with self.session.get(f"{self.base_url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status != 200:
                    return None
                return Snapshot.from_text(await r.text(errors="replace"))
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    def _track_gpu(self, snap: Snapshot | None) -> float | None:
        """Record the GPU memory peak; return the utilisation now (None: unknown)."""
        reading = nvml_reading() if self.local else None
        used, util, source = (reading.used_bytes, reading.utilization, "nvml") if reading else (None, None, None)
        if reading is None and snap is not None:
            used, util, source = snap.total(*GPU_MEMORY), snap.total(*GPU_UTILIZATION), "server"
        if used is not None:
            self.obs.peak_gpu_memory_bytes = max(used, self.obs.peak_gpu_memory_bytes or 0.0)
            self.obs.gpu_memory_source = source
        return util

    def _sample(self, snap: Snapshot, util: float | None) -> None:
        self.obs.samples.append(Sample(time.perf_counter(), snap.total(*RUNNING), snap.total(*WAITING),
                                       snap.total(*KV_USAGE), util))

    async def start(self) -> None:
        self.obs.before = await self.scrape()
        self._track_gpu(self.obs.before)

    async def run(self) -> None:
        while self.obs.before is not None:
            await asyncio.sleep(self.interval_s)
            snap = await self.scrape()
            util = self._track_gpu(snap)
            if snap is not None:
                self._sample(snap, util)

    async def stop(self) -> ServerObservation:
        self.obs.after = await self.scrape()
        util = self._track_gpu(self.obs.after)
        if self.obs.after is not None:
            self._sample(self.obs.after, util)
        return self.obs


def _delta(before: Snapshot, after: Snapshot, names: tuple[str, ...]) -> float | None:
    a, b = after.total(*names), before.total(*names)
    return None if a is None else a - (b or 0.0)


def _gauge_stats(samples: list[Sample]) -> dict[str, float | None]:
    kv = [s.kv_cache_usage_perc for s in samples if s.kv_cache_usage_perc is not None]
    waiting = [s.num_requests_waiting for s in samples if s.num_requests_waiting is not None]
    running = [s.num_requests_running for s in samples if s.num_requests_running is not None]
    util = [s.gpu_utilization_perc for s in samples if s.gpu_utilization_perc is not None]
    return {"kv_cache_usage_max": max(kv) if kv else None, "kv_cache_usage_mean": sum(kv) / len(kv) if kv else None,
            "num_requests_waiting_max": max(waiting) if waiting else None,
            "num_requests_running_max": max(running) if running else None,
            "gpu_utilization_mean": sum(util) / len(util) if util else None}


def _histogram(before: Snapshot, after: Snapshot, names: tuple[str, ...]) -> tuple[str | None, list[tuple[float, float]]]:
    """(name read, bucket deltas) of the first histogram of `names` the server exposes."""
    for name in names:
        if after.buckets(name):
            return name, bucket_delta(after.buckets(name), before.buckets(name))
    return None, []


def _histogram_percentiles(prefix: str, buckets: list[tuple[float, float]], cfg: IntervalConfig,
                           out: dict[str, Any]) -> None:
    """`{prefix}_p{50,95,99}_ms` (None in the lowest bucket), their buckets and intervals, in ms."""
    for q in (50, 95, 99):
        key = f"{prefix}_p{q}_ms"
        found = bucket_quantile(q / 100, buckets, cfg)
        out[key] = None if found is None or found.interpolated is None else found.interpolated * 1000.0
        if found is not None:
            upper = found.upper * 1000.0
            out[f"{key.removesuffix('_ms')}_bucket_ms"] = [found.lower * 1000.0, "inf" if upper == float("inf") else upper]
            iv = found.interval
            out.setdefault("ci", {})[key] = {**iv.to_json(), "estimate": iv.estimate * 1000.0, "low": iv.low * 1000.0,
                                             "high": "inf" if iv.high == float("inf") else iv.high * 1000.0}


def server_summary(obs: ServerObservation, cfg: IntervalConfig | None = None) -> dict[str, Any]:
    """The `server` object of summary.json (+ generation/prompt token deltas for cross-checks)."""
    out: dict[str, Any] = {"available": obs.before is not None and obs.after is not None}
    keys = ("queue_time_p50_ms", "queue_time_p95_ms", "queue_time_p99_ms", "queue_time_histogram",
            "num_preemptions", "prefix_cache_hit_rate", "generation_tokens", "prompt_tokens",
            "tokenization_time_mean_ms", "tokenization_time_p95_ms", *SPEC_KEYS)
    out.update(dict.fromkeys(keys, None))
    out.update(_gauge_stats(obs.samples))
    out["peak_gpu_memory_bytes"] = obs.peak_gpu_memory_bytes
    out["gpu_memory_source"] = obs.gpu_memory_source
    if obs.before is None or obs.after is None:
        return out
    before, after = obs.before, obs.after
    cfg = cfg or IntervalConfig()
    name, queue = _histogram(before, after, QUEUE_TIME)
    out["queue_time_histogram"] = name
    out["queue_time_buckets"] = [["inf" if le == float("inf") else le, count] for le, count in queue]
    _histogram_percentiles("queue_time", queue, cfg, out)
    _tokenization(before, after, cfg, out)
    out["num_preemptions"] = _delta(before, after, PREEMPTIONS)
    queries, hits = _delta(before, after, PREFIX_QUERIES), _delta(before, after, PREFIX_HITS)
    out["prefix_cache_hit_rate"] = hits / queries if queries and hits is not None else None
    out["generation_tokens"] = _delta(before, after, GENERATION_TOKENS)
    out["prompt_tokens"] = _delta(before, after, PROMPT_TOKENS)
    out.update(spec_decode_summary(before, after))
    return out


def _tokenization(before: Snapshot, after: Snapshot, cfg: IntervalConfig, out: dict[str, Any]) -> None:
    """CPU tokenization time per request (conveyor:tokenization_time_seconds): mean and p95."""
    name, buckets = _histogram(before, after, TOKENIZATION_TIME)
    if name is None:
        return
    total, count = _delta(before, after, (f"{name}_sum",)), _delta(before, after, (f"{name}_count",))
    out["tokenization_time_mean_ms"] = 1000.0 * total / count if total is not None and count else None
    found = bucket_quantile(0.95, buckets, cfg)
    if found is not None:
        out["tokenization_time_p95_le_ms"] = found.upper * 1000.0
        out["tokenization_time_p95_ms"] = None if found.interpolated is None else found.interpolated * 1000.0


def config_info(snap: Snapshot | None) -> dict[str, str]:
    for name in CONFIG_INFO:
        labels = snap.labels(name) if snap is not None else None
        if labels is not None:
            return labels
    return {}


async def get_json(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> Any:
    """GET url as JSON, or None on any failure (identity endpoints are optional)."""
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as r:
            return await r.json(content_type=None) if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
