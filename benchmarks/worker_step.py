#!/usr/bin/env python3
"""Where one decode step of the model runner spends its time: host input preparation, sampler, model.

B requests with `--context` prompt tokens each are prefilled, then decode steps are timed through
`ModelRunner.execute` (the engine's call). Host preparation (numpy inputs + device copies) and the
sampler (greedy, and temperature/top-p/top-k) are timed on their own over the same batch; the rest
of the step is the forward pass and the LM head.

    PYTHONPATH=src python benchmarks/worker_step.py --batch-sizes 1 8 32          # SmolLM2 GGUF, CPU
    PYTHONPATH=src python benchmarks/worker_step.py --device cuda --model benchmarks/models/qwen3-0.6b \\
        --load-format dummy --batch-sizes 1 64 256

With `--prefill-chunk C` it also times a *mixed* step: the B decodes plus a C-token prefill chunk of one
more request (`mixed_step_ms`; on CUDA it replays a mixed-step graph unless --enforce-eager or
--cudagraph-mode full_decode_only).

Prints one JSON line per batch size ("RESULT {...}"), times in milliseconds (median of --steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from conveyor.config import CacheConfig, CUDAGraphMode, DeviceConfig, LoadFormat, ModelConfig, SchedulerConfig
from conveyor.core.outputs import NO_NEW_BLOCKS, CachedRequestData, NewRequestData, SchedulerOutput
from conveyor.sampling_params import SamplingParams
from conveyor.worker.input_batch import prepare_host_batch
from conveyor.worker.model_runner import ModelRunner
from conveyor.worker.sampling_metadata import SamplingRequest, build_sampling_batch

RANDOM = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=None)
GREEDY = SamplingParams(temperature=0.0, max_tokens=None)
HEADROOM_TOKENS = 256
"""Decode steps a request may take after its prompt (blocks are allocated for them up front)."""


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class DecodeDriver:
    """Prefills `batch_size` requests, then hands out one decode SchedulerOutput per step."""

    def __init__(self, runner: ModelRunner, batch_size: int, context: int) -> None:
        self.runner, self.ids = runner, [f"r{i}" for i in range(batch_size)]
        # No more blocks than max_model_len needs: a longer table would disqualify the CUDA graphs.
        blocks_each = -(-(context + HEADROOM_TOKENS) // runner.block_size)
        self.blocks = {rid: list(range(i * blocks_each, (i + 1) * blocks_each)) for i, rid in enumerate(self.ids)}
        prompt = [(7 * j) % 1000 + 10 for j in range(context)]
        new = [NewRequestData(rid, prompt, [], GREEDY, self.blocks[rid], 0) for rid in self.ids]
        prefill = SchedulerOutput(new, CachedRequestData(), dict.fromkeys(self.ids, context), context * batch_size)
        runner.execute(prefill)
        self.num_computed = context

    def step(self) -> None:
        num_reqs = len(self.ids)
        cached = CachedRequestData(list(self.ids), [NO_NEW_BLOCKS] * num_reqs, [self.num_computed] * num_reqs)
        self.runner.execute(SchedulerOutput([], cached, dict.fromkeys(self.ids, 1), len(self.ids)))
        self.num_computed += 1

    def add_chunked_request(self, chunk: int, first_block: int) -> None:
        """Register request "p" (chunk + 1 prompt tokens: a chunk of `chunk` never reaches sampling)."""
        blocks = list(range(first_block, first_block + -(-(chunk + 1) // self.runner.block_size)))
        prompt = [(11 * j) % 1000 + 10 for j in range(chunk + 1)]
        self.runner.execute(SchedulerOutput([NewRequestData("p", prompt, [], GREEDY, blocks, 0)],
                                            CachedRequestData(), {"p": 1}, 1))

    def mixed_step(self, chunk: int) -> None:
        """The decodes plus tokens [0, chunk) of "p" again (same slots, same values)."""
        num_reqs = len(self.ids)
        ids = [*self.ids, "p"]
        cached = CachedRequestData(ids, [NO_NEW_BLOCKS] * (num_reqs + 1), [self.num_computed] * num_reqs + [0])
        self.runner.execute(SchedulerOutput([], cached, {**dict.fromkeys(self.ids, 1), "p": chunk}, num_reqs + chunk))
        self.num_computed += 1


def measure(runner: ModelRunner, batch_size: int, args: argparse.Namespace) -> dict[str, float]:
    driver = DecodeDriver(runner, batch_size, args.context)
    step_ms = median_ms(driver.step, runner.device, args.steps)
    states = [runner.states[rid] for rid in driver.ids]
    num_tokens = {rid: 1 for rid in driver.ids}
    for state in states:
        state.num_computed_tokens = len(state.token_ids) - 1

    @torch.inference_mode()
    def host_prep() -> None:
        runner.staging.device_batch(prepare_host_batch(states, num_tokens, runner.block_size), runner.block_size)

    logits = torch.randn(batch_size, runner.vocab_size, device=runner.device)

    def sampler_with(params: SamplingParams) -> Callable[[], object]:
        requests = [SamplingRequest(params, s.token_ids, s.num_prompt_tokens) for s in states]
        return lambda: runner.sampler(logits.clone(), build_sampling_batch(requests, runner.vocab, runner.device))

    mixed = {}
    if args.prefill_chunk:
        driver.add_chunked_request(args.prefill_chunk, first_block=len(driver.blocks) * len(driver.blocks["r0"]))
        mixed = {"prefill_chunk": args.prefill_chunk, "mixed_step_ms": round(median_ms(
            lambda: driver.mixed_step(args.prefill_chunk), runner.device, args.steps), 3)}
    return {
        **mixed, "batch_size": batch_size, "context": args.context, "step_ms": round(step_ms, 3),
        "host_prep_ms": round(median_ms(host_prep, runner.device, args.steps), 3),
        "sampler_greedy_ms": round(median_ms(sampler_with(GREEDY), runner.device, args.steps), 3),
        "sampler_random_ms": round(median_ms(sampler_with(RANDOM), runner.device, args.steps), 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto", choices=[f.value for f in LoadFormat])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--cudagraph-mode", default="full", choices=[m.value for m in CUDAGraphMode])
    parser.add_argument("--prefill-chunk", type=int, default=0, help="also time decodes + a chunk of this size")
    args = parser.parse_args()
    max_batch = max(args.batch_sizes)
    max_len = max(args.context + HEADROOM_TOKENS, args.prefill_chunk + 1)
    runner = ModelRunner(
        ModelConfig(model=args.model, load_format=LoadFormat(args.load_format)),
        CacheConfig(num_blocks_override=(max_batch + 1) * (-(-max_len // 16))),
        SchedulerConfig(max_num_seqs=max_batch + 1, max_model_len=max_len,
                        max_num_batched_tokens=max(2048, max_batch * args.context, max_batch + args.prefill_chunk)),
        DeviceConfig(device=args.device, num_threads=args.num_threads, enforce_eager=args.enforce_eager,
                     cudagraph_mode=CUDAGraphMode(args.cudagraph_mode)),
    )
    runner.initialize_kv_cache()
    info = {"device": args.device, "dtype": str(runner.dtype), "backend": runner.attention_backend,
            "cuda_graphs": getattr(runner, "cuda_graphs", None) is not None,
            "torch": torch.__version__, "layers": runner.arch_config.num_hidden_layers}
    for batch_size in args.batch_sizes:
        runner.states.clear()
        print("RESULT " + json.dumps({**info, **measure(runner, batch_size, args)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
