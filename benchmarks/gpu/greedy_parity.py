#!/usr/bin/env python3
"""Greedy tokens of the CUDA fast path (Triton attention + CUDA graphs) against the torch reference path.

Five engines over the same dummy-weight model and the first --num-requests prompts of nano256, greedy,
--max-tokens each, run through the real EngineCore (scheduler, runner, sampler) with a token budget of
--max-num-batched-tokens (512: prompts span several mixed prefill/decode steps): (1) torch attention
backend, eager; (2) Triton backend, eager; (3) Triton with decode CUDA graphs only; (4) Triton with
decode and mixed-step graphs (`full`); (5) the same with async scheduling. Reports, per pair, the fraction of requests whose token lists
are identical and the mean index of the first difference. (2), (3) and (4) run the same kernels (graphs
only remove launches; padded GEMMs may pick another cuBLAS algorithm); (1) vs (2) differ through bf16
rounding inside attention, which can flip a near-tie of random-weight logits.

    PYTHONPATH=src python benchmarks/gpu/greedy_parity.py --model benchmarks/models/qwen3-0.6b
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from conveyor.config import (
    CacheConfig,
    CUDAGraphMode,
    DeviceConfig,
    EngineConfig,
    LoadFormat,
    ModelConfig,
    SchedulerConfig,
)
from conveyor.engine.model_setup import build_engine_core
from conveyor.model.attention import get_attention_backend
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams


def generate(args: argparse.Namespace, backend: str, enforce_eager: bool,
             mode: CUDAGraphMode = CUDAGraphMode.FULL, async_scheduling: bool = False) -> dict[str, list[int]]:
    from offline import make_workload  # same directory

    config = EngineConfig(
        model=ModelConfig(model=args.model, load_format=LoadFormat.DUMMY, dtype="bfloat16",
                          num_hidden_layers_override=args.num_layers),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=4096, async_scheduling=async_scheduling),
        cache=CacheConfig(kv_cache_memory_bytes=4 << 30, enable_prefix_caching=False),
        device=DeviceConfig(device="cuda", enforce_eager=enforce_eager, cudagraph_mode=mode),
    )
    core = build_engine_core(config)
    if backend == "torch":
        core.runner.model.set_attention_backend(get_attention_backend("torch"))
    prompts, _ = make_workload()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_tokens)
    for index, prompt in enumerate(prompts[: args.num_requests]):
        core.add_request(Request(str(index), prompt, params, time.monotonic()))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(args.num_requests)}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    del core
    gc.collect()
    torch.cuda.empty_cache()
    return tokens


def compare(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict:
    firsts = [next((i for i, (x, y) in enumerate(zip(a[r], b[r])) if x != y), len(a[r])) for r in a]
    return {"identical_requests": sum(a[r] == b[r] for r in a) / len(a),
            "mean_first_difference": sum(firsts) / len(firsts),
            "token_agreement": sum(x == y for r in a for x, y in zip(a[r], b[r])) / sum(len(a[r]) for r in a)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = parser.parse_args()
    torch_eager = generate(args, "torch", True)
    triton_eager = generate(args, "triton", True)
    decode_graphs = generate(args, "triton", False, CUDAGraphMode.FULL_DECODE_ONLY)
    triton_graphs = generate(args, "triton", False, CUDAGraphMode.FULL)
    pipelined = generate(args, "triton", False, CUDAGraphMode.FULL, async_scheduling=True)
    print("GREEDY " + json.dumps({
        "model": args.model, "num_requests": args.num_requests, "max_tokens": args.max_tokens,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "decode_graphs_vs_triton_eager": compare(decode_graphs, triton_eager),
        "triton_graphs_vs_triton_eager": compare(triton_graphs, triton_eager),
        "async_scheduling_vs_triton_graphs": compare(pipelined, triton_graphs),
        "triton_eager_vs_torch_eager": compare(triton_eager, torch_eager),
        "triton_graphs_vs_torch_eager": compare(triton_graphs, torch_eager),
    }))


if __name__ == "__main__":
    main()
