"""How many requests a point's next repeat sends: longer after a repeat that did not show the rate sustained.

The model: a point whose bounds are met but whose server was not shown to sustain the offered rate
(sustained.py: the completed rate fell short, waiting grew, or the steady-state window held too few
scrapes) is undecided because the run was too short to tell a burst from a rate. Another repeat of the
same length asks the same question again; a longer one answers it. So the next repeat sends
`lengthen_factor` times as many requests as the last one sent, up to `max_requests`. A decided point,
or one undecided because a bound's interval straddles it, keeps its length: more repeats narrow that.
A run cannot send more requests than its trace holds (the runner takes the trace's first N requests;
replaying the trace twice within one run would make its second pass hit the prefix cache of the
first); when it sends fewer than it asked for, the point says so and stops lengthening.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from conveyor.bench.measure.summary import RunSummary


@dataclass(frozen=True)
class Lengthening:
    """What the next repeat of a point sends."""

    num_requests: int | None
    """Requests the next repeat asks for (None: the run's own count, the trace or --num-requests)."""
    note: str | None = None
    """Why the point could not be lengthened further (None: it still can); set once, then kept."""


def requests_sent(summary: RunSummary) -> int:
    """Requests the run sent, warm-up and cool-down included (older runs: those it measured)."""
    return summary.num_sent if summary.num_sent is not None else summary.num_prompts


def next_length(current: Lengthening, summary: RunSummary, not_sustained: str | None,
                factor: float, max_requests: int | None) -> Lengthening:
    """The next repeat's length after a valid repeat that sent `summary`, given the point's pooled verdict
    (`not_sustained`: its sustained-rate reason, None when the rate was shown sustained or a bound decides)."""
    if not_sustained is None or current.note is not None or factor <= 1.0:
        return current
    sent = requests_sent(summary)
    if current.num_requests is not None and sent < current.num_requests:
        return Lengthening(sent, f"cannot lengthen past the trace's {sent} requests: a longer trace would show "
                                 "whether the rate is sustained")
    target = math.ceil(sent * factor)
    if max_requests is not None and target > max_requests:
        target = max_requests
    if target <= sent:
        return Lengthening(current.num_requests, f"not lengthened past --max-requests {max_requests}")
    return Lengthening(target)
