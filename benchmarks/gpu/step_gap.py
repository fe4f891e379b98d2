#!/usr/bin/env python3
"""Where a nano256 run's time goes against roofline.py's bound, by phase: the prefill steps, then the
decode steps grouped by how many requests ran in them.

The bound (roofline.py) prefills every prompt at the matrix rate, then runs decode step j over the
requests whose output is at least j long, each step reading the weights once plus every running
request's K/V (or doing the step's matmul FLOPs, whichever is longer). A measured step (offline.py
--step-times-out) is matched to the bound's decode steps with the same number of running requests; the
steps that ran prompt tokens are compared, together, with the bound's prefill plus the bound's decode
steps at their running counts. Under async scheduling a step's time is the gap between two returns.

    python benchmarks/gpu/step_gap.py --model qwen3-0.6b --steps steps.jsonl [--bandwidth-gb-s 3039 --tflops 700.7]
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections import defaultdict
from dataclasses import dataclass

from roofline import MODELS, ModelShape, model_shape, nano256

BUCKETS = ((0, 16), (17, 64), (65, 128), (129, 192), (193, 256))


@dataclass(frozen=True)
class Ceilings:
    bandwidth_b_s: float
    flop_s: float


def decode_bound_by_running(shape: ModelShape, ceil: Ceilings) -> dict[int, list[float]]:
    """The bound's decode step times, keyed by the step's running count (several steps may share one)."""
    prompt_lens, out_lens = nano256()
    steps: dict[int, list[float]] = defaultdict(list)
    for step in range(1, max(out_lens) + 1):
        running = [p + step for p, o in zip(prompt_lens, out_lens) if o >= step]
        hbm = (2 * shape.num_params + shape.kv_bytes_per_token * sum(running)) / ceil.bandwidth_b_s
        steps[len(running)].append(max(hbm, 2 * shape.num_params * len(running) / ceil.flop_s))
    return steps


def prefill_bound_s(shape: ModelShape, ceil: Ceilings) -> float:
    prompt_lens, _ = nano256()
    flops = sum(2 * shape.num_params * p + shape.attn_flops_per_pair * p * (p + 1) / 2 for p in prompt_lens)
    return flops / ceil.flop_s


def bucket_of(running: int) -> str:
    for low, high in BUCKETS:
        if low <= running <= high:
            return f"decode {low}-{high}"
    return f"decode >{BUCKETS[-1][1]}"


def gap_table(steps: list[dict], shape: ModelShape, ceil: Ceilings) -> list[dict]:
    """One row a phase: steps, measured seconds, bound seconds, and the measured time per step."""
    bound_by_running = decode_bound_by_running(shape, ceil)
    used: dict[int, int] = defaultdict(int)
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    rows["prefill steps"][2] += prefill_bound_s(shape, ceil)
    previous = 0.0
    for step in steps:
        took, previous = step["t_s"] - previous, step["t_s"]
        running = step["num_running_reqs"]
        candidates = bound_by_running.get(running, [])
        bound = candidates[used[running] % len(candidates)] if candidates else 0.0
        used[running] += 1
        row = rows["prefill steps" if step["num_prompt_tokens"] else bucket_of(running)]
        row[0] += 1
        row[1] += took
        row[2] += bound
    return [{"phase": name, "steps": int(n), "measured_s": round(m, 4), "bound_s": round(b, 4),
             "excess_s": round(m - b, 4), "ms_per_step": round(1e3 * m / n, 3) if n else None,
             "bound_ms_per_step": round(1e3 * b / n, 3) if n else None}
            for name, (n, m, b) in sorted(rows.items(), key=_phase_order)]


def _phase_order(item: tuple[str, list[float]]) -> tuple[int, int]:
    """Prefill first, then the decode buckets from the smallest batch."""
    name = item[0]
    return (0, 0) if not name.startswith("decode") else (1, int(name.split()[1].split("-")[0].lstrip(">")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a folder under benchmarks/models")
    parser.add_argument("--steps", required=True, nargs="+", help="offline.py --step-times-out files")
    parser.add_argument("--bandwidth-gb-s", type=float, default=3039.0, help="session 14's H100 copy rate")
    parser.add_argument("--tflops", type=float, default=700.7, help="session 14's H100 8192^3 bf16 rate")
    args = parser.parse_args()
    shape = model_shape(json.loads((MODELS / args.model / "config.json").read_text()))
    ceil = Ceilings(args.bandwidth_gb_s * 1e9, args.tflops * 1e12)
    for path in args.steps:
        steps = [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line]
        rows = gap_table(steps, shape, ceil)
        total = {k: round(sum(r[k] for r in rows), 4) for k in ("measured_s", "bound_s", "excess_s")}
        print(json.dumps({"file": path, **total}))
        for row in rows:
            print("GAP " + json.dumps(row))


if __name__ == "__main__":
    main()
