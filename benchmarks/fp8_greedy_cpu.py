#!/usr/bin/env python3
"""FP8 weights on SmolLM2's real weights, on the CPU: a preview of benchmarks/gpu/real_weights.py --fp8.

The engine refuses `--quantization fp8` on the CPU (its matmuls are a GPU path), but `torch._scaled_mm` runs
here, so the model runner itself (tests/worker/runner_harness.py's toy scheduler: every request every step,
greedy) serves the embedded GGUF dequantized to float32, to bfloat16, and to bfloat16 with its projections in
FP8 (per tensor, vLLM's `fp8`; per channel and per token, `ptpc_fp8`). The sixteen prompts of
real_weights.py, `--max-tokens` tokens each with EOS ignored. Reported per run: the first position where its
tokens leave float32's (per prompt and the median), and for the FP8 runs where they leave bfloat16's. No FP8
KV cache here: its store and read are Triton kernels.

    PYTHONPATH=src python benchmarks/fp8_greedy_cpu.py [--max-tokens 64]

Prints one JSON line ("RESULT {...}").
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "worker"), str(ROOT / "benchmarks" / "gpu")]

from real_weights import first_divergence, prompt_ids  # noqa: E402
from runner_harness import BLOCK_SIZE, ToyScheduler  # noqa: E402

from conveyor.config import CacheConfig, DeviceConfig, ModelConfig, Quantization, SchedulerConfig  # noqa: E402
from conveyor.model.loader import embedded_gguf_path  # noqa: E402
from conveyor.sampling_params import SamplingParams  # noqa: E402
from conveyor.worker.model_runner import ModelRunner  # noqa: E402

RUNS = {"fp32": ("float32", Quantization.NONE), "bf16": ("bfloat16", Quantization.NONE),
        "fp8_weights": ("bfloat16", Quantization.FP8), "ptpc_fp8_weights": ("bfloat16", Quantization.PTPC_FP8)}


def greedy(gguf: pathlib.Path, prompts: list[list[int]], dtype: str, quantization: Quantization,
           max_tokens: int) -> list[list[int]]:
    runner = ModelRunner(ModelConfig(model=str(gguf), dtype=dtype, quantization=quantization),
                         CacheConfig(block_size=BLOCK_SIZE, num_blocks_override=1024),
                         SchedulerConfig(max_num_seqs=len(prompts), max_num_batched_tokens=1024, max_model_len=512),
                         DeviceConfig())
    runner.initialize_kv_cache()
    scheduler = ToyScheduler()
    for index, ids in enumerate(prompts):
        scheduler.add(f"r{index}", ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    outputs = scheduler.run(runner)
    return [outputs[f"r{index}"] for index in range(len(prompts))]


def compare(max_tokens: int) -> dict[str, object]:
    gguf = embedded_gguf_path()
    prompts = prompt_ids(gguf)
    tokens = {name: greedy(gguf, prompts, dtype, q, max_tokens) for name, (dtype, q) in RUNS.items()}
    result: dict[str, object] = {"num_prompts": len(prompts), "max_tokens": max_tokens, "device": "cpu",
                                 "torch": torch.__version__}
    for name in ("bf16", "fp8_weights", "ptpc_fp8_weights"):
        divergence = [first_divergence(o, r) for o, r in zip(tokens[name], tokens["fp32"])]
        result |= {f"{name}_vs_fp32_first_divergence": divergence,
                   f"{name}_median_vs_fp32": statistics.median(divergence)}
    for name in ("fp8_weights", "ptpc_fp8_weights"):
        divergence = [first_divergence(o, r) for o, r in zip(tokens[name], tokens["bf16"])]
        result |= {f"{name}_vs_bf16_first_divergence": divergence,
                   f"{name}_median_vs_bf16": statistics.median(divergence)}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    print("RESULT " + json.dumps(compare(args.max_tokens)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
