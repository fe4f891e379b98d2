#!/usr/bin/env python3
"""Host cost of one step of n-gram prompt lookup (worker/spec_decode/ngram_proposer.py) at batch scale.

B requests of --context tokens each are synced once; then every timed step appends one token to each
request (what a decode step does) and proposes for all of them, as the runner does every step. Two
token sources, alternated in the same process so that machine noise hits both alike:
- `random`: ids uniform in [0, 10000), nano256's prompts (almost no match: the cost floor);
- `zipf`: ids drawn from a Zipf(1.2) law over 50k ids with phrases re-quoted, like text, and the
  appended tokens drawn alike (many positions share the last token: the gathers run over thousands
  of candidates, and many requests get drafts).

    PYTHONPATH=src python benchmarks/ngram_proposer.py --batch-size 256 --context 2048 --steps 50

Prints one JSON line per source ("RESULT {...}"): median / min / max milliseconds per step over the
repeats (each repeat = the median of --steps steps), and the share of requests that got drafts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from conveyor.worker.spec_decode.ngram_proposer import NgramParams, NgramProposer


def make_histories(source: str, batch_size: int, context: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    if source == "random":
        return [rng.integers(0, 10000, context).tolist() for _ in range(batch_size)]
    histories = []
    for _ in range(batch_size):
        tokens = (rng.zipf(1.2, context) % 50000).tolist()
        for _ in range(context // 200):  # re-quote a 16-token phrase now and then
            start, to = rng.integers(0, context - 16, 2)
            tokens[to : to + 16] = tokens[start : start + 16]
        histories.append(tokens[:context])
    return histories


def next_token(source: str, rng: np.random.Generator) -> int:
    return int(rng.integers(0, 10000)) if source == "random" else int(rng.zipf(1.2) % 50000)


def time_steps(proposer: NgramProposer, histories: list[list[int]], source: str, steps: int,
               seed: int) -> tuple[float, float]:
    """(median ms per step, share of requests with drafts) over `steps` decode-like steps."""
    rng = np.random.default_rng(seed)
    ids = [f"r{i}" for i in range(len(histories))]
    times, with_drafts = [], 0
    for _ in range(steps):
        for tokens in histories:
            tokens.append(next_token(source, rng))
        start = time.perf_counter()
        drafts = proposer.propose_tokens(ids, histories)
        times.append((time.perf_counter() - start) * 1e3)
        with_drafts += len(drafts)  # only the requests that got drafts are in it
    return statistics.median(times), with_drafts / (steps * len(histories))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    args = parser.parse_args()
    params = NgramParams(min_n=args.prompt_lookup_min, max_n=args.prompt_lookup_max,
                         num_speculative_tokens=args.num_speculative_tokens,
                         max_model_len=args.context + args.steps * args.repeats + 64)
    sources = ("random", "zipf")
    setups = {s: (NgramProposer(params), make_histories(s, args.batch_size, args.context, 0)) for s in sources}
    for proposer, histories in setups.values():  # first sync of the whole prompts: not a steady-state step
        proposer.propose_tokens([f"r{i}" for i in range(len(histories))], histories)
    results: dict[str, list[tuple[float, float]]] = {s: [] for s in sources}
    for repeat in range(args.repeats):
        for source in sources:
            results[source].append(time_steps(*setups[source], source, args.steps, seed=repeat))
    for source, runs in results.items():
        ms = [r[0] for r in runs]
        print("RESULT " + json.dumps({
            "source": source, "batch_size": args.batch_size, "context": args.context,
            "ms_per_step_median": round(statistics.median(ms), 3), "ms_min": round(min(ms), 3),
            "ms_max": round(max(ms), 3), "share_with_drafts": round(statistics.mean(r[1] for r in runs), 3),
            "params": vars(args),
        }))


if __name__ == "__main__":
    main()
