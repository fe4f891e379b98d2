"""How much of a trace's prompt tokens a prefix cache can serve from the trace itself: its own sharing.

A run that starts from an empty (or salted) cache can hit only what its own earlier requests cached, so
this is the hit rate an isolated run should measure. A standalone prompt (or a session's first turn)
can hit the longest prefix it has in common with an earlier prompt (a PrefixTrie over its words, or its
token ids, scaled to its prompt_len); a later session turn is sent with the whole conversation before
it (the earlier inputs and answers: load/sessions.py), all of it cached by the turn before, so that
history counts as shared. As in vLLM the cache serves whole blocks only and never the prompt's last
token (one token must be computed), so each request's share is rounded down to a block. Requests are
taken in trace order, which keeps a session's turns in order; which of two sharing prompts comes first
does not change the total.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from conveyor.bench.trace.prefix_trie import PrefixTrie
from conveyor.bench.trace.traces import TraceRequest

DEFAULT_BLOCK_SIZE = 16
"""vLLM's and conveyor's default KV block size, used when the server does not say its own."""


def _units(req: TraceRequest) -> Sequence[Hashable]:
    if req.prompt_token_ids is not None:
        return req.prompt_token_ids
    if req.messages is not None:  # the chat body as the trace sends it: a message may lack either key
        return [w for m in req.messages for w in (m.get("role", ""), *str(m.get("content", "")).split())]
    return str(req.prompt).split()


def _seen_prefix(trie: PrefixTrie, units: Sequence[Hashable]) -> int:
    """Leading units already inserted by an earlier prompt (looked up before this one is inserted)."""
    node, depth = 0, 0
    for u in units:
        nxt = trie.children[node].get(u)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


def expected_hit_rate(requests: Sequence[TraceRequest], block_size: int = DEFAULT_BLOCK_SIZE) -> float | None:
    """Cacheable prompt tokens / prompt tokens sent, over the trace (None: no prompt tokens)."""
    trie, history = PrefixTrie(), dict[str, int]()
    shared_total = sent_total = 0
    for req in requests:
        before = history.get(str(req.session_id), 0) if req.turn else 0
        sent = before + req.prompt_len
        if before:
            shared = before
        else:
            units = _units(req)
            shared = round(_seen_prefix(trie, units) * req.prompt_len / len(units)) if units else 0
            trie.insert(units)
        shared_total += min(shared, sent - 1) // block_size * block_size if sent > 0 else 0
        sent_total += sent
        if req.session_id is not None and req.turn is not None:
            history[str(req.session_id)] = sent + req.output_len
    return shared_total / sent_total if sent_total else None
