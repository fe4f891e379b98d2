"""Speculative decoding's run-level numbers, from the counter deltas vLLM (and conveyor) expose.

The model, vLLM's definitions (vllm/v1/spec_decode/metrics.py): a *draft* is one request's drafts
verified in one engine step; `num_draft_tokens` of them were proposed and `num_accepted_tokens` kept
(the target model's own token of each step is not counted). Over a run:

- acceptance rate = accepted / draft tokens (in [0, 1]);
- mean accepted length = 1 + accepted / drafts: tokens a verifying step emits on average, the target's
  own token included (vLLM's "mean acceptance length"), so 1.0 means speculation bought nothing;
- per-position acceptance rate [i] = drafts whose position i was accepted / drafts.

All are null when the server exposes no spec-decoding counters (speculation off, or an older server).
"""

from __future__ import annotations

from typing import Any

from conveyor.bench.measure.prom_text import Snapshot
from conveyor.bench.measure.server_summary import ServerSummary

NUM_DRAFTS = ("vllm:spec_decode_num_drafts_total",)
NUM_DRAFT_TOKENS = ("vllm:spec_decode_num_draft_tokens_total",)
NUM_ACCEPTED_TOKENS = ("vllm:spec_decode_num_accepted_tokens_total",)
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
"""Labelled by `position` (0-based draft position)."""
SPEC_KEYS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
             "spec_decode_acceptance_rate", "spec_decode_mean_accepted_length",
             "spec_decode_acceptance_rate_per_pos")
"""The keys `spec_decode_summary` sets (summary.json's `server` object)."""


def _delta(before: Snapshot, after: Snapshot, names: tuple[str, ...]) -> float | None:
    a, b = after.total(*names), before.total(*names)
    return None if a is None else a - (b or 0.0)


def _per_position_delta(before: Snapshot, after: Snapshot) -> list[float]:
    """Accepted tokens per draft position over the run, position 0 first."""
    after_by_pos = after.by_label(ACCEPTED_PER_POS, "position")
    before_by_pos = before.by_label(ACCEPTED_PER_POS, "position")
    positions = sorted(after_by_pos, key=int)
    return [after_by_pos[p] - before_by_pos.get(p, 0.0) for p in positions]


def spec_decode_summary(before: Snapshot, after: Snapshot) -> dict[str, Any]:
    """The SPEC_KEYS of one run (module docstring), null where the server has no such counters."""
    out: dict[str, Any] = dict.fromkeys(SPEC_KEYS)
    drafts, draft_tokens = _delta(before, after, NUM_DRAFTS), _delta(before, after, NUM_DRAFT_TOKENS)
    accepted = _delta(before, after, NUM_ACCEPTED_TOKENS)
    if drafts is None or draft_tokens is None or accepted is None:
        return out
    out.update(spec_decode_num_drafts=drafts, spec_decode_num_draft_tokens=draft_tokens,
               spec_decode_num_accepted_tokens=accepted)
    if draft_tokens > 0:
        out["spec_decode_acceptance_rate"] = accepted / draft_tokens
    if drafts > 0:
        out["spec_decode_mean_accepted_length"] = 1.0 + accepted / drafts
        out["spec_decode_acceptance_rate_per_pos"] = [n / drafts for n in _per_position_delta(before, after)]
    return out


def describe_spec_decode(server: ServerSummary) -> str | None:
    """One line for `conveyor bench run` (None: the run verified no drafts)."""
    draft_tokens = server.value("spec_decode_num_draft_tokens")
    if not draft_tokens:
        return None
    per_pos = ", ".join(f"{rate:.2f}" for rate in server.numbers("spec_decode_acceptance_rate_per_pos"))
    return (f"speculative decoding: {100.0 * (server.value('spec_decode_acceptance_rate') or 0.0):.1f}% of "
            f"{draft_tokens:,.0f} draft tokens accepted, mean accepted length "
            f"{server.value('spec_decode_mean_accepted_length') or 0.0:.2f} tokens per verifying step "
            f"(per position: {per_pos})")
