"""Where an online run's engine time went, from conveyor's step log (`STEPLOG=N session.sh online ...`).

    python3 benchmarks/gpu/step_split.py step_log_cbf16_r16.jsonl [more.jsonl ...]

Each step is one of three kinds: decode only, mixed (decodes and at least one prefill chunk), prefill only.
For each kind: the steps, their share of the engine's busy time (the sum of `step_time_s`, which tiles it:
core/step_log.py), the mean step in ms, and the mean batch (decode rows, prefill tokens, context tokens).
A decode-only step's time against its batch is the TPOT floor; what mixed steps add over it is what
prefill chunks cost the running requests. Under async scheduling one record can carry part of its
neighbour's time (core/step_log.py), so means over many steps are what to read, not single records.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from conveyor.core.step_log import StepRecord

KINDS = ("decode", "mixed", "prefill")


def kind_of(record: StepRecord) -> str:
    """decode: no prefill tokens; prefill: no decode rows; mixed: both."""
    if record.num_prefill_tokens == 0:
        return "decode"
    return "mixed" if record.num_decode_reqs else "prefill"


@dataclass(frozen=True)
class KindSummary:
    """The steps of one kind in one log."""

    kind: str
    num_steps: int
    busy_share: float
    """Of the log's summed step time."""
    mean_step_ms: float
    mean_decode_reqs: float
    mean_prefill_tokens: float
    mean_context_tokens: float


def summarize(records: Sequence[StepRecord]) -> list[KindSummary]:
    """One row per kind present, in KINDS order."""
    busy = sum(r.step_time_s for r in records) or 1.0
    rows = []
    for kind in KINDS:
        steps = [r for r in records if kind_of(r) == kind]
        if not steps:
            continue
        n = len(steps)
        rows.append(KindSummary(
            kind, n, sum(r.step_time_s for r in steps) / busy, 1e3 * sum(r.step_time_s for r in steps) / n,
            sum(r.num_decode_reqs for r in steps) / n, sum(r.num_prefill_tokens for r in steps) / n,
            sum(r.num_context_tokens for r in steps) / n))
    return rows


def read_log(path: pathlib.Path) -> list[StepRecord]:
    return [StepRecord.from_json(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def table(name: str, rows: Iterable[KindSummary]) -> str:
    lines = [f"{name}", "kind     steps  busy%  mean ms  decode rows  prefill tok  context tok"]
    for row in rows:
        lines.append(f"{row.kind:<8} {row.num_steps:>5}  {100 * row.busy_share:5.1f}  {row.mean_step_ms:7.2f}  "
                     f"{row.mean_decode_reqs:11.1f}  {row.mean_prefill_tokens:11.1f}  {row.mean_context_tokens:11.0f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("logs", nargs="+", type=pathlib.Path, help="step_log_*.jsonl files")
    args = parser.parse_args(argv)
    for path in args.logs:
        records = read_log(path)
        if not records:
            print(f"{path}: no steps (was the server started with --step-log-size?)", file=sys.stderr)
            continue
        print(table(f"{path.name}: {len(records)} steps", summarize(records)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
