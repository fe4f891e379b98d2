"""Speculative decoding's Prometheus counters, under vLLM's names, labels and meaning.

vLLM (vllm/v1/spec_decode/metrics.py, SpecDecodingProm) creates them only when speculative decoding is
configured, with one `position` child per draft position 0..K-1 created up front, and increments them
from each step's SpecDecodingStats: a *draft* is one request's drafts verified in one step. Acceptance
rate = rate(accepted) / rate(draft_tokens); mean acceptance length = 1 + rate(accepted) / rate(drafts);
per-position acceptance = per_pos / drafts. Counters are declared without `_total` (prometheus_client
appends it).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from conveyor.engine.types import SchedulerStats
from conveyor.server.metric_families import ENGINE_INDEX, LABELS


class SpecDecodeMetrics:
    """The four vllm:spec_decode_* counters of one server."""

    def __init__(self, registry: CollectorRegistry, model_name: str, num_speculative_tokens: int) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=registry).labels(model_name, ENGINE_INDEX)

        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                          LABELS + ("position",), registry=registry)
        self.num_accepted_tokens_per_pos = [per_pos.labels(model_name, ENGINE_INDEX, str(pos))
                                            for pos in range(num_speculative_tokens)]

    def observe(self, stats: SchedulerStats) -> None:
        spec = stats.spec_decoding
        if spec is None:
            return
        self.num_drafts.inc(spec.num_drafts)
        self.num_draft_tokens.inc(spec.num_draft_tokens)
        self.num_accepted_tokens.inc(spec.num_accepted_tokens)
        for counter, count in zip(self.num_accepted_tokens_per_pos, spec.num_accepted_tokens_per_pos):
            counter.inc(count)
