"""N-gram prompt lookup: draft the tokens that followed the latest earlier occurrence of the request's
last n tokens, in its own prompt + output.

The model: for n from `prompt_lookup_max` down to `prompt_lookup_min`, the request's suffix of n
tokens is searched among its earlier tokens; the first n with a match wins, and among matches of that
length the latest one (its end nearest the suffix); the up to K tokens after it are the drafts. A
request without a match gets none. Where vLLM 0.32 keeps the *earliest* match of the longest n, we keep
the latest: recent text (the code being edited, the passage just quoted) predicts the next tokens best.

It runs on the host every step for every request, so it is vectorized over the batch with numpy and
skips what it can prove futile: every live request's tokens sit in one int32 matrix, next to a bitset
of the min_n-grams each has seen (`NgramIndex`, both synced by appends), and only the requests whose
last min_n tokens hit a set bit -- those that repeated them, and a few collisions -- are looked up:
one comparison over their [M, L] rows finds the positions whose token equals each one's last token
(the only possible match ends), and max_n - 1 gathers over those candidates measure how far back each
match goes. At ~no repetition (random ids) a step is then O(batch), not O(batch x history).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from conveyor.worker.kv_cache import KVCacheSpec
from conveyor.worker.spec_decode.ngram_index import NgramIndex
from conveyor.worker.spec_decode.proposer import ProposalInputs


@dataclass(frozen=True)
class NgramParams:
    """What the lookup needs (SpeculativeConfig's ngram keys and the engine's max_model_len)."""

    min_n: int
    """prompt_lookup_min: shortest suffix matched."""
    max_n: int
    """prompt_lookup_max: longest suffix matched (tried first)."""
    num_speculative_tokens: int
    """K: most drafts per request."""
    max_model_len: int
    """No draft may sit at or past this position."""


class NgramProposer:
    """Drafts for each request from its own tokens (see the module docstring)."""

    def __init__(self, params: NgramParams) -> None:
        self.params = params
        self.index = NgramIndex(params.min_n)

    def propose(self, inputs: ProposalInputs) -> dict[str, list[int]]:
        batch = inputs.batch
        states = batch if len(inputs.proposing_rows) == len(batch) else [batch[row] for row in inputs.proposing_rows]
        return self.propose_tokens([s.request_id for s in states], [s.token_ids for s in states])

    @property
    def kv_cache_spec(self) -> KVCacheSpec | None:
        return None

    def bind_kv_cache(self, num_blocks: int) -> None:
        """Nothing to allocate: the lookup reads tokens only."""

    def propose_tokens(self, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> dict[str, list[int]]:
        """Drafts of the requests that get some, by id; token_ids[i] = request i's prompt + output."""
        if not request_ids:
            return {}
        rows, lengths, may_match = self.index.sync_many(request_ids, token_ids)
        looked_up = np.flatnonzero(may_match)  # the others have no match
        if looked_up.size == 0:
            return {}
        found = propose_ngram_drafts(self.index.matrix, rows[looked_up], lengths[looked_up], self.params)
        return {request_ids[i]: request_drafts for i, request_drafts in zip(looked_up.tolist(), found) if request_drafts}

    def drop(self, request_ids: Iterable[str]) -> None:
        self.index.drop(request_ids)


def propose_ngram_drafts(matrix: np.ndarray, rows: np.ndarray, lengths: np.ndarray,
                         params: NgramParams) -> list[list[int]]:
    """Drafts of the requests whose tokens are matrix[rows[i], :lengths[i]] (see the module docstring)."""
    width = int(lengths.max())
    drafts: list[list[int]] = [[] for _ in range(len(rows))]
    if width < 2:  # nothing before anyone's last token
        return drafts
    tokens = matrix[rows, :width]  # [B, W]; beyond a row's length: stale, never read as a match
    candidate_req, candidate_end, match_len = _match_lengths(tokens, lengths, params)
    long_enough = match_len >= params.min_n
    candidate_req, candidate_end = candidate_req[long_enough], candidate_end[long_enough]
    if candidate_req.size == 0:
        return drafts
    # Longest match first, then the latest: one key, maximised per request over its candidates
    # (np.nonzero lists them grouped by request, so reduceat over the group starts does it).
    key = match_len[long_enough] * width + candidate_end
    group_starts = np.flatnonzero(np.r_[True, candidate_req[1:] != candidate_req[:-1]])
    best_end = np.maximum.reduceat(key, group_starts) % width  # [M]
    requests = candidate_req[group_starts]  # [M]
    first = best_end + 1  # the token after the match
    num_tokens = lengths[requests]
    counts = np.minimum(np.minimum(params.num_speculative_tokens, num_tokens - first),
                        params.max_model_len - num_tokens)  # [M]
    columns = np.minimum(first[:, None] + np.arange(params.num_speculative_tokens), width - 1)
    picked = tokens[requests[:, None], columns].tolist()  # [M, K]
    for request, count, row in zip(requests.tolist(), counts.tolist(), picked):
        if count > 0:
            drafts[request] = row[:count]
    return drafts


def _match_lengths(tokens: np.ndarray, lengths: np.ndarray,
                   params: NgramParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(request, end position, match length capped at max_n) of every earlier position whose token
    equals the request's last token, ends at or after min_n - 1 and leaves a token after it."""
    num_reqs, width = tokens.shape
    last_index = lengths - 1  # [B]
    last = tokens[np.arange(num_reqs), last_index]
    # Positions past a row's tokens hold ABSENT_TOKEN and never match; flatnonzero is ~15x faster
    # than a 2-D nonzero here, and the few candidates are filtered afterwards.
    flat = np.flatnonzero(tokens[:, : width - 1] == last[:, None])  # [C] grouped by request
    candidate_req, candidate_end = np.divmod(flat, width - 1)
    keep = (candidate_end <= last_index[candidate_req] - 1) & (candidate_end >= params.min_n - 1)
    candidate_req, candidate_end, flat = candidate_req[keep], candidate_end[keep], flat[keep]
    # Walk back from each candidate end and from its request's last token in the flattened matrix
    # (1-D takes are several times faster than 2-D gathers), only over the candidates still matching.
    tokens_flat = tokens.reshape(-1)
    earlier_flat = candidate_req * width + candidate_end  # flat index of each candidate's end
    suffix_flat = candidate_req * width + last_index[candidate_req]
    match_len = np.ones(candidate_req.shape[0], dtype=np.int64)
    alive = np.flatnonzero(candidate_end >= 1)  # candidates that can still grow
    for back in range(1, params.max_n):
        same = tokens_flat[earlier_flat[alive] - back] == tokens_flat[suffix_flat[alive] - back]
        alive = alive[same]
        if alive.size == 0:
            break
        match_len[alive] += 1
        alive = alive[candidate_end[alive] >= back + 1]
    return candidate_req, candidate_end, match_len


def propose_ngram_ref(token_ids: Sequence[int], params: NgramParams) -> list[int]:
    """Plain-Python reference of one request's drafts (the tests compare it with the vectorized one)."""
    num_tokens = len(token_ids)
    budget = min(params.num_speculative_tokens, params.max_model_len - num_tokens)
    for n in range(params.max_n, params.min_n - 1, -1):
        if n >= num_tokens or budget <= 0:
            continue
        suffix = list(token_ids[num_tokens - n:])
        for end in range(num_tokens - 2, n - 2, -1):  # latest first; the match must leave a token after it
            if list(token_ids[end - n + 1 : end + 1]) == suffix:
                return list(token_ids[end + 1 : end + 1 + budget])
    return []
