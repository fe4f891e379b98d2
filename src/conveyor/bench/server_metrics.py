"""Server-side view of a run: /metrics scraped before, during and after, reduced to run-level numbers.

Counters and histograms are cumulative since server start, so everything is a delta between the scrape
before the first request and the scrape after the last one: queue-time percentiles come from the delta
of the `vllm:request_queue_time_seconds` buckets (histogram_quantile), preemptions and token counts from
counter deltas, the prefix-cache hit rate from hits/queries deltas. Gauges (running, waiting, KV usage)
are sampled every scrape interval into a time series. vLLM's V1 names are read first, older vLLM names
as fallbacks, so the same code measures conveyor and vLLM. A server without /metrics gives
available=false and every number null; the run stays valid.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from conveyor.bench.prom_text import Snapshot, bucket_delta, histogram_quantile

RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREEMPTIONS = ("vllm:num_preemptions_total", "vllm:num_preemptions")
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
GENERATION_TOKENS = ("vllm:generation_tokens_total",)
PROMPT_TOKENS = ("vllm:prompt_tokens_total",)
QUEUE_TIME = "vllm:request_queue_time_seconds"
GPU_MEMORY = ("conveyor:gpu_memory_peak_bytes", "conveyor:gpu_memory_used_bytes")
CONFIG_INFO = ("conveyor:config_info", "vllm:cache_config_info")
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0"})


@dataclass
class Sample:
    """One sampled point of the gauges (a line of server_timeseries.jsonl before t is made relative)."""

    t_abs: float
    num_requests_running: float | None
    num_requests_waiting: float | None
    kv_cache_usage_perc: float | None


@dataclass
class ServerObservation:
    """Everything scraped over a run."""

    before: Snapshot | None = None
    after: Snapshot | None = None
    samples: list[Sample] = field(default_factory=list)
    peak_gpu_memory_bytes: float | None = None


def _nvml_used_bytes() -> float | None:
    """Total used memory over local GPUs via NVML, or None when pynvml or a GPU is missing."""
    try:
        import pynvml  # optional; only meaningful when the server runs on this machine
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        used = sum(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).used for i in range(count))
        return float(used) if count else None
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

    def _track_gpu(self, snap: Snapshot | None) -> None:
        used = _nvml_used_bytes() if self.local else None
        if used is None and snap is not None:
            used = snap.total(*GPU_MEMORY)
        if used is not None:
            self.obs.peak_gpu_memory_bytes = max(used, self.obs.peak_gpu_memory_bytes or 0.0)

    def _sample(self, snap: Snapshot) -> None:
        self.obs.samples.append(Sample(time.perf_counter(), snap.total(*RUNNING), snap.total(*WAITING),
                                       snap.total(*KV_USAGE)))

    async def start(self) -> None:
        self.obs.before = await self.scrape()
        self._track_gpu(self.obs.before)

    async def run(self) -> None:
        while self.obs.before is not None:
            await asyncio.sleep(self.interval_s)
            snap = await self.scrape()
            if snap is not None:
                self._sample(snap)
            self._track_gpu(snap)

    async def stop(self) -> ServerObservation:
        self.obs.after = await self.scrape()
        if self.obs.after is not None:
            self._sample(self.obs.after)
        self._track_gpu(self.obs.after)
        return self.obs


def _delta(before: Snapshot, after: Snapshot, names: tuple[str, ...]) -> float | None:
    a, b = after.total(*names), before.total(*names)
    return None if a is None else a - (b or 0.0)


def _gauge_stats(samples: list[Sample]) -> dict[str, float | None]:
    kv = [s.kv_cache_usage_perc for s in samples if s.kv_cache_usage_perc is not None]
    waiting = [s.num_requests_waiting for s in samples if s.num_requests_waiting is not None]
    running = [s.num_requests_running for s in samples if s.num_requests_running is not None]
    return {"kv_cache_usage_max": max(kv) if kv else None, "kv_cache_usage_mean": sum(kv) / len(kv) if kv else None,
            "num_requests_waiting_max": max(waiting) if waiting else None,
            "num_requests_running_max": max(running) if running else None}


def server_summary(obs: ServerObservation) -> dict[str, Any]:
    """The `server` object of summary.json (+ generation/prompt token deltas for cross-checks)."""
    out: dict[str, Any] = {"available": obs.before is not None and obs.after is not None}
    keys = ("queue_time_p50_ms", "queue_time_p95_ms", "queue_time_p99_ms", "num_preemptions",
            "prefix_cache_hit_rate", "generation_tokens", "prompt_tokens")
    out.update(dict.fromkeys(keys, None))
    out.update(_gauge_stats(obs.samples))
    out["peak_gpu_memory_bytes"] = obs.peak_gpu_memory_bytes
    if obs.before is None or obs.after is None:
        return out
    before, after = obs.before, obs.after
    queue = bucket_delta(after.buckets(QUEUE_TIME), before.buckets(QUEUE_TIME))
    for q in (50, 95, 99):
        value = histogram_quantile(q / 100, queue)
        out[f"queue_time_p{q}_ms"] = None if value is None else value * 1000.0
    out["num_preemptions"] = _delta(before, after, PREEMPTIONS)
    queries, hits = _delta(before, after, PREFIX_QUERIES), _delta(before, after, PREFIX_HITS)
    out["prefix_cache_hit_rate"] = hits / queries if queries and hits is not None else None
    out["generation_tokens"] = _delta(before, after, GENERATION_TOKENS)
    out["prompt_tokens"] = _delta(before, after, PROMPT_TOKENS)
    return out


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
