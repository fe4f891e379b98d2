"""Stamp a conveyor trace with the send times `vllm bench serve --request-rate R --seed S` gives its requests.

    python benchmarks/gpu/vllm_arrivals.py t480_s0.jsonl --rate 16 --seed 0 --out t480_s0_r16.jsonl
    conveyor simulate --trace t480_s0_r16.jsonl --arrival replay ...

vLLM 0.24's client (vllm/benchmarks/serve.py `get_request`, after `np.random.seed(seed)` in `main_async`)
draws every request's delay from numpy's global generator, gamma(shape=burstiness, scale=1 / (R·burstiness))
(Poisson at burstiness 1), sums them, and rescales the sums so the last request is sent at exactly N / R
seconds. Conveyor's own Poisson arrivals (trace/arrivals.py) do not rescale, so at 480 requests and 16 req/s
their offered rate moves ±6% from seed to seed where vLLM's is always R: a simulation of a vLLM-client run
compares only on vLLM's schedule. The random dataset's lengths come from `conveyor trace import --format
random` with the same seed and --tokenizer (trace_synthetic.py: vLLM's own draws, so the same lengths).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
from collections.abc import Sequence

import numpy as np

from conveyor.bench.trace.traces import TraceError, make_trace, read_trace, write_trace


def vllm_send_times(num_requests: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Seconds from the start at which vLLM 0.24's client sends each of `num_requests` requests."""
    np.random.seed(seed)  # vLLM draws from the global generator, seeded so in main_async
    theta = 1.0 / (rate * burstiness)
    delays = np.cumsum([np.random.gamma(shape=burstiness, scale=theta) for _ in range(num_requests)])
    return [float(t) for t in delays * (num_requests / rate / delays[-1])]


def stamp(trace_path: pathlib.Path, rate: float, seed: int, out: pathlib.Path) -> int:
    """Write `trace_path`'s requests with vLLM's send times as arrival_s to `out`; returns how many."""
    trace = read_trace(trace_path)
    times = vllm_send_times(len(trace.requests), rate, seed)
    requests = [dataclasses.replace(r, arrival_s=round(t, 6)) for r, t in zip(trace.requests, times)]
    generator = dict(trace.header.generator, vllm_arrivals={"rate": rate, "seed": seed})
    write_trace(make_trace(requests, trace.header.seed, generator), out)
    return len(requests)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", type=pathlib.Path, help="a conveyor trace (its requests in send order)")
    parser.add_argument("--rate", type=float, required=True, help="vllm bench serve --request-rate (finite)")
    parser.add_argument("--seed", type=int, default=0, help="vllm bench serve --seed (default 0)")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args(argv)
    if not 0 < args.rate < float("inf"):
        print(f"vllm_arrivals.py: error: --rate must be a finite number > 0 (got {args.rate})", file=sys.stderr)
        return 2
    try:
        count = stamp(args.trace, args.rate, args.seed, args.out)
    except TraceError as error:
        print(f"vllm_arrivals.py: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {count} requests sent over {count / args.rate:.2f} s (vLLM's schedule, seed {args.seed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
