"""Issue 36: where a run's ITL p50 comes from, measured against its simulated twin.

    python itl_gaps.py MEASURED_RUN_DIR SIMULATED_RUN_DIR [...pairs]

For each pair: chunks against output tokens (are SSE chunks coalesced?), the median one-decode step and
the engine's median time between steps from the step log, the share and median of the gaps under 18 ms
(one-decode steps on the embedded SmolLM2 on CPU), and the deciles of the per-chunk gaps pooled over
requests (vLLM's ITL) of both runs. A one-off analysis: it reads files and prints, nothing else.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import statistics
import sys

LOW_MODE_S = 0.018
"""Gaps under this are one-decode steps here (those take ~11-12 ms, any multi-row step >= 20 ms)."""


def rows(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gaps(run: pathlib.Path) -> list[float]:
    return sorted(g for r in rows(run / "requests.jsonl") if r["status"] == "completed" for g in r["itl_s"])


def deciles_ms(values: list[float]) -> list[float]:
    return [round(1e3 * values[int(q * len(values) / 10)], 1) for q in range(1, 10)]


def report(measured: pathlib.Path, simulated: pathlib.Path) -> None:
    done = [r for r in rows(measured / "requests.jsonl") if r["status"] == "completed"]
    chunks, tokens = sum(len(r["itl_s"]) + 1 for r in done), sum(r["output_tokens"] for r in done)
    steps = rows(measured / "step_log.jsonl")
    one = [s["step_time_s"] for s in steps if s["num_prefill_reqs"] == 0 and s["num_decode_reqs"] == 1]
    between = [b["start_s"] - a["end_s"] for a, b in itertools.pairwise(steps) if b["start_s"] - a["end_s"] < 0.05]
    got, sim = gaps(measured), gaps(simulated)
    low = [g for g in got if g < LOW_MODE_S]
    print(f"{measured}: chunks {chunks} / tokens {tokens}; one-decode step {1e3 * statistics.median(one):.2f} ms "
          f"+ between {1e3 * statistics.median(between):.2f} ms; gaps < 18 ms: share {len(low) / len(got):.2f}, "
          f"median {1e3 * statistics.median(low):.2f} ms (simulated share "
          f"{sum(g < LOW_MODE_S for g in sim) / len(sim):.2f})")
    print(f"  ITL p10..p90 ms measured  {deciles_ms(got)}")
    print(f"  ITL p10..p90 ms simulated {deciles_ms(sim)}")


if __name__ == "__main__":
    args = [pathlib.Path(a) for a in sys.argv[1:]]
    for measured_dir, simulated_dir in zip(args[::2], args[1::2]):
        report(measured_dir, simulated_dir)
