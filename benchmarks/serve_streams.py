"""Serving throughput and latency of `conveyor serve` on this CPU: 1 stream vs N concurrent streams.

Starts `conveyor serve` (embedded SmolLM2-135M, port 0) unless `--url` is given, then for each
concurrency level sends that many streaming /v1/completions at once (distinct prompts of about 20
tokens, `--max-tokens` output tokens each, greedy, `ignore_eos`). Reports output tokens/s (sum of
`usage.completion_tokens` / wall time from the first send to the last `[DONE]`), TTFT (first chunk
carrying text) and ITL (gaps between text chunks) percentiles, as `vllm bench serve` defines them.
The peer measured in the same run is concurrency 1 on the same server: the gain is continuous batching.

    PYTHONPATH=src python benchmarks/serve_streams.py                  # 1 and 32 streams, 64 tokens each
    PYTHONPATH=src python benchmarks/serve_streams.py --concurrency 1 8 32 --max-tokens 32
    # TTFT on ~1,000-token prompts, one at a time, 5 distinct prompts (no prefix shared from the first word)
    PYTHONPATH=src python benchmarks/serve_streams.py --url URL --concurrency 1 --max-tokens 2 --prompt-words 1000 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx2 as httpx

URL_LINE = re.compile(r"serving \S+ at (http://\S+)/v1")


@dataclass(frozen=True)
class StreamResult:
    """One request as the client saw it."""

    ttft_s: float
    itl_s: list[float]
    num_output_tokens: int


WORDS = ("river", "stone", "lantern", "harbor", "meadow", "copper", "violet", "thunder", "orchard", "compass",
         "glacier", "ember", "willow", "falcon", "canyon", "saffron", "marble", "tide", "quarry", "beacon")


def prompt_for(index: int, prompt_words: int) -> str:
    """A prompt distinct from its first word on: `prompt_words` extra words (~1 token each for SmolLM2's
    tokenizer), so no two requests share a cached prefix beyond the template."""
    if prompt_words <= 0:
        return f"Request {index}: write a short story about a lighthouse keeper and a storm."
    words = (WORDS[(index * 7 + 3 * k + k * k) % len(WORDS)] for k in range(prompt_words))
    return f"{index} " + " ".join(words)


async def one_stream(client: httpx.AsyncClient, index: int, max_tokens: int, prompt_words: int = 0) -> StreamResult:
    body = {"prompt": prompt_for(index, prompt_words),
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    chunk_times: list[float] = []
    num_tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event["choices"] and event["choices"][0]["text"]:
                chunk_times.append(time.perf_counter())
            if event.get("usage"):
                num_tokens = event["usage"]["completion_tokens"]
    gaps = [later - earlier for earlier, later in zip(chunk_times, chunk_times[1:])]
    return StreamResult(ttft_s=chunk_times[0] - sent, itl_s=gaps, num_output_tokens=num_tokens)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_level(url: str, concurrency: int, max_tokens: int, prompt_words: int = 0,
                    repeats: int = 1) -> dict[str, float]:
    """`repeats` rounds of `concurrency` requests at once (each round's prompts new), pooled."""
    # A new connection per request: llama-server closes idle keep-alive connections, and a pooled one reused
    # just after it was closed ends the request as "Server disconnected" (seen on issue 39's runs).
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    results: list[StreamResult] = []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await one_stream(client, -1, 4, prompt_words)  # warm-up
        started = time.perf_counter()
        for r in range(repeats):
            batch = (one_stream(client, r * concurrency + i, max_tokens, prompt_words) for i in range(concurrency))
            results += await asyncio.gather(*batch)
        wall_s = time.perf_counter() - started
    tokens = sum(r.num_output_tokens for r in results)
    ttfts = [r.ttft_s for r in results]
    itls = [gap for r in results for gap in r.itl_s]
    return {"concurrency": concurrency, "output_tokens": tokens, "wall_s": round(wall_s, 2),
            "output_tok_per_s": round(tokens / wall_s, 1),
            "ttft_p50_ms": round(statistics.median(ttfts) * 1e3), "ttft_p95_ms": round(percentile(ttfts, 0.95) * 1e3),
            "itl_p50_ms": round(statistics.median(itls) * 1e3, 1), "itl_p95_ms": round(percentile(itls, 0.95) * 1e3, 1)}


def start_server(serve_args: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "conveyor", "serve", "--port", "0", *serve_args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if match := URL_LINE.search(line):
            return proc, match.group(1)
    raise SystemExit("conveyor serve exited before serving")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an already running server (default: start one)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=0, help="~tokens per prompt (0: a short one)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds per concurrency level")
    parser.add_argument("--serve-args", default="--max-model-len 512 --max-num-seqs 32",
                        help="flags for the server this script starts")
    args = parser.parse_args()
    proc, url = (None, args.url) if args.url else start_server(args.serve_args.split())
    try:
        rows = [asyncio.run(run_level(url, c, args.max_tokens, args.prompt_words, args.repeats))
                for c in args.concurrency]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    print(json.dumps({"hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                      "python": platform.python_version(), "max_tokens": args.max_tokens, "prompt_words": args.prompt_words,
                      "serve_args": args.serve_args, "levels": rows}, indent=1))


if __name__ == "__main__":
    main()
