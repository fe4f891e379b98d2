"""Verification of draft tokens: keep the drafts the target agrees with, then one token of the target.

The model (Leviathan et al. 2023, for deterministic drafts). At each verified position i of a
request -- after its last confirmed token and after each of its drafts d_0..d_{K-1} -- the runner
samples a target token t_i exactly as it samples any position: the same penalties (over a history
that holds d_0..d_{i-1}), min_tokens, temperature, min_p, top-k/top-p, and the seeded stream of
output position num_output_tokens + i. Draft d_i is accepted iff t_i == d_i; the output is
t_0 .. t_a with a the first rejected position (or K: then t_K is the bonus token).

Why this is exact rejection sampling: conveyor's drafts are deterministic (n-gram lookup, a greedy
draft model), q = one_hot(d). Leviathan accepts d with probability min(1, p(d) / q(d)) = p(d) and
on rejection samples norm(max(p - q, 0)), which is p restricted to the tokens != d. One draw
t ~ p, accepted iff t == d, does both: P(accept) = p(d), and t given t != d has exactly that
residual law. Greedy (t = argmax p) is the temperature-0 case. And since the token kept at every
position is the target's own draw from that position's stream, a seeded request emits the very
tokens it emits without speculation. `rejection_sample_ref` is the textbook two-draw form, for
the statistical tests.

Everything here stays on the device: one gather, one comparison and a cumprod over [S, K + 1].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from conveyor.worker.sampling_metadata import host_to_device


@dataclass(frozen=True)
class DraftLayout:
    """Where each sampling request's verified positions sit among the R rows of logits, on the device.

    Request s owns rows row_starts[s] .. row_starts[s] + num_drafts[s] (R = sum of 1 + num_drafts)."""

    num_drafts: torch.Tensor
    """[S] int64 drafts each request verifies (0: a plain sample)."""
    row_starts: torch.Tensor
    """[S] int64 first logits row of each request."""
    draft_token_ids: torch.Tensor
    """[S, max(1, K)] int64 drafts, right-padded (padding is masked by num_drafts, never compared)."""
    num_rows: int
    """R."""


def draft_layout(drafts: Sequence[Sequence[int]], device: torch.device) -> DraftLayout:
    """The layout of S sampling requests whose drafts are `drafts[s]` (empty: none)."""
    counts = [len(d) for d in drafts]
    starts, total = [], 0
    for count in counts:
        starts.append(total)
        total += 1 + count
    width = max([1, *counts])
    padded = [list(d) + [0] * (width - len(d)) for d in drafts]
    return DraftLayout(
        num_drafts=host_to_device(counts, torch.int64, device),
        row_starts=host_to_device(starts, torch.int64, device),
        draft_token_ids=host_to_device(padded, torch.int64, device),
        num_rows=total,
    )


@dataclass(frozen=True)
class VerifiedDrafts:
    """The outcome of verification, on the device."""

    token_ids: torch.Tensor
    """[S, K + 1] int64: column i is the target's token at position i (an accepted draft equals it);
    request s keeps columns 0 .. num_accepted[s]. Columns past its drafts repeat its last row."""
    num_accepted: torch.Tensor
    """[S] int64 accepted drafts of each request."""

    def to_lists(self) -> list[list[int]]:
        """Each request's kept tokens (accepted drafts, then the target's token), with ONE host copy."""
        both = torch.cat([self.num_accepted.unsqueeze(1), self.token_ids], dim=1).tolist()
        return [row[1 : row[0] + 2] for row in both]


def verify_drafts(target_token_ids: torch.Tensor, layout: DraftLayout) -> VerifiedDrafts:
    """target_token_ids [R]: the token sampled at every row of the layout -> what each request keeps."""
    assert target_token_ids.shape == (layout.num_rows,), (target_token_ids.shape, layout.num_rows)
    width = layout.draft_token_ids.shape[1]
    columns = torch.arange(width + 1, device=target_token_ids.device)  # [K + 1]
    # Row of (request, column), clamped to the request's last row so that padding reads a real row.
    rows = layout.row_starts.unsqueeze(1) + torch.minimum(columns.unsqueeze(0), layout.num_drafts.unsqueeze(1))
    targets = target_token_ids[rows]  # [S, K + 1]
    agrees = targets[:, :width] == layout.draft_token_ids
    agrees &= columns[:width].unsqueeze(0) < layout.num_drafts.unsqueeze(1)  # [S, K]
    num_accepted = agrees.long().cumprod(dim=1).sum(dim=1)  # leading agreements
    return VerifiedDrafts(token_ids=targets, num_accepted=num_accepted)


def verify_drafts_ref(target_token_ids: Sequence[int], drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Plain-Python `verify_drafts` + `to_lists`: targets in layout order -> kept tokens per request."""
    kept, row = [], 0
    for request_drafts in drafts:
        targets = list(target_token_ids[row : row + 1 + len(request_drafts)])
        num_accepted = 0
        while num_accepted < len(request_drafts) and targets[num_accepted] == request_drafts[num_accepted]:
            num_accepted += 1
        kept.append(targets[: num_accepted + 1])
        row += 1 + len(request_drafts)
    return kept


def rejection_sample_ref(probs: torch.Tensor, drafts: Sequence[int], generator: torch.Generator) -> list[int]:
    """Textbook speculative sampling of one request with a deterministic draft (q = one_hot(d)).

    probs [K + 1, V]: the target's distribution at each verified position (given the drafts before
    it). Draft d_i is accepted if u < p_i(d_i) / q_i(d_i) = p_i(d_i), u ~ U(0, 1); else a token is
    drawn from norm(max(p_i - one_hot(d_i), 0)) and the request stops; all accepted: a bonus draw
    from p_K."""
    kept: list[int] = []
    for position, draft in enumerate(drafts):
        p = probs[position]
        if torch.rand((), generator=generator).item() < p[draft].item():
            kept.append(draft)
            continue
        residual = p.clone()
        residual[draft] = 0.0
        kept.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator).item()))
        return kept
    kept.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator).item()))
    return kept
