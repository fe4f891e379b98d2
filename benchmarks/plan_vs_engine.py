#!/usr/bin/env python3
"""How close is `conveyor plan`'s KV budget to what the engine actually sizes on a GPU?

For each model directory (config.json only; dummy bf16 weights) this builds the engine core exactly as
`conveyor serve --device cuda` does (load, profile the largest step, size the KV cache from
gpu_memory_utilization, capture CUDA graphs) and compares its block count with the plan's
kv_budget // bytes_per_block for the same max_num_seqs / max_num_batched_tokens / utilization.
Needs torch with CUDA (run on the GPU machine):

    for m in qwen3-0.6b llama-3.1-8b; do PYTHONPATH=src python benchmarks/plan_vs_engine.py benchmarks/models/$m; done
    PYTHONPATH=src python benchmarks/plan_vs_engine.py benchmarks/models/llama-3.1-70b --tensor-parallel-size 2
    PYTHONPATH=src python benchmarks/plan_vs_engine.py benchmarks/models/llama-3.1-8b --kv-cache-dtype fp8

With --tensor-parallel-size N (N GPUs) both sides are per rank: the engine's block count is the group's
minimum, the plan's is the largest shard's (`conveyor plan --tensor-parallel-size N`).

One model per process (a second model in the same process would see the first's memory as in use).
Prints one JSON line ("RESULT {...}").
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import time

import torch

from conveyor.bench.plan.gpu_catalog import GPU
from conveyor.bench.plan.memory import PlanInputs, fit_on, load_shape, model_memory
from conveyor.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoadFormat,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from conveyor.engine.model_setup import build_engine_core


def measure(model_dir: pathlib.Path, args: argparse.Namespace) -> dict:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), load_format=LoadFormat.DUMMY, dtype="bfloat16"),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.max_model_len),
        cache=CacheConfig(gpu_memory_utilization=args.gpu_memory_utilization, cache_dtype=args.kv_cache_dtype),
        device=DeviceConfig(device="cuda", enforce_eager=args.enforce_eager),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size))
    started = time.monotonic()
    core = build_engine_core(config)
    engine_blocks = core.limits.num_kv_blocks
    elapsed_s = time.monotonic() - started
    core.shutdown()
    total_bytes = torch.cuda.get_device_properties(0).total_memory
    inputs = PlanInputs(dtype="bfloat16", kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=args.max_num_seqs, context_len=args.max_model_len,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                        tensor_parallel_size=args.tensor_parallel_size)
    memory = model_memory(load_shape(model_dir), inputs)
    fit = fit_on(GPU("this", torch.cuda.get_device_name(0), total_bytes, 0.0), memory, inputs)
    plan_blocks = fit.kv_budget_bytes // (memory.kv_bytes_per_token * 16)
    return {"model": model_dir.name, "tensor_parallel_size": args.tensor_parallel_size,
            "kv_cache_dtype": args.kv_cache_dtype,
            "gpu": torch.cuda.get_device_name(0), "total_bytes": total_bytes,
            "engine_blocks": engine_blocks, "plan_blocks": plan_blocks,
            "plan_error": (plan_blocks - engine_blocks) / engine_blocks,
            "plan_weights_bytes": memory.weights_bytes, "plan_overhead_bytes": memory.activation_bytes +
            memory.runtime_bytes, "torch_peak_bytes": torch.cuda.max_memory_allocated(0),
            "startup_s": round(elapsed_s, 1), "inputs": {k: str(v) for k, v in vars(args).items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=pathlib.Path, help="directory with config.json")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs (ranks); figures are per rank")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                        help="both sides: fp8 should give twice auto's blocks")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print("RESULT " + json.dumps(measure(args.model, args), default=str), flush=True)


if __name__ == "__main__":
    main()
