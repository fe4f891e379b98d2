#!/usr/bin/env python3
"""The peer's online workload as a conveyor trace: `vllm bench serve --dataset-name random
--random-input-len 1024 --random-output-len 256 --random-range-ratio 0.5 --ignore-eos --seed 0`.

Input lengths uniform in [512, 1536], output lengths uniform in [128, 384], prompt token ids uniform over
the tokenizer's vocabulary (SmolLM2's 49,152, as in the peer run), sent as token ids (completions
endpoint). Untimed: `conveyor bench run --rate R --num-requests N` stamps Poisson arrivals.

    PYTHONPATH=src python benchmarks/gpu/online_trace.py --num-requests 720 --out online.jsonl
"""

from __future__ import annotations

import argparse
import random

from conveyor.bench.trace.traces import TraceRequest, make_trace, write_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=720)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--range-ratio", type=float, default=0.5)
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    low_in, high_in = int(args.input_len * (1 - args.range_ratio)), int(args.input_len * (1 + args.range_ratio))
    low_out, high_out = int(args.output_len * (1 - args.range_ratio)), int(args.output_len * (1 + args.range_ratio))
    requests = []
    for index in range(args.num_requests):
        prompt_len, output_len = rng.randint(low_in, high_in), rng.randint(low_out, high_out)
        ids = [rng.randrange(args.vocab_size) for _ in range(prompt_len)]
        requests.append(TraceRequest(request_id=f"random-{index}", request_class="random", prompt_len=prompt_len,
                                     output_len=output_len, prompt_token_ids=ids))
    write_trace(make_trace(requests, args.seed, {"name": "vllm-random", **vars(args)}), args.out)


if __name__ == "__main__":
    main()
