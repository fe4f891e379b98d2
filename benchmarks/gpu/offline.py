#!/usr/bin/env python3
"""Offline throughput of conveyor on the fixed "nano256" workload, comparable to the vLLM peer run.

The workload is drawn exactly as ../shared/peers/h200/bench_offline.py's make_workload does (nano-vllm's
bench.py): random.seed(0); per request its prompt length randint(100, 1024) then its ids
randint(0, 10000); then 256 output lengths randint(100, 1024). ignore_eos, max_tokens = the request's
output length, temperature 0.6 (no top-k/top-p), all 256 submitted at once, timed from submission to
the last completion after a warm-up of two short requests. Weights are random (`--load-format dummy`,
bf16), as in the peer run.

The engine is driven at the EngineCore level (token ids in, token ids out): the same thing vLLM's
`skip_tokenizer_init=True, detokenize=False` measures, and the dummy model has no tokenizer. The
step loop, scheduler, model runner, sampler and CUDA graphs are exactly those of `conveyor serve`.

    PYTHONPATH=src python benchmarks/gpu/offline.py --model benchmarks/models/qwen3-0.6b [--enforce-eager]
    PYTHONPATH=src python benchmarks/gpu/offline.py --model ... --profile-steps 8 --profile-out trace.txt
    PYTHONPATH=src python benchmarks/gpu/offline.py --model ... --speculative-config \
        '{"method": "ngram", "num_speculative_tokens": 3}'    # speculation's overhead (random ids: ~0 accepted)
    PYTHONPATH=src python benchmarks/gpu/offline.py --model benchmarks/models/llama-3.1-70b --tensor-parallel-size 2

Prints one JSON line ("RESULT {...}") and appends it to --out if given.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import random
import sys
import time
from dataclasses import asdict, dataclass

from conveyor.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoadFormat,
    ModelConfig,
    ParallelConfig,
    Quantization,
    SchedulerConfig,
)
from conveyor.core.stats import SpecDecodingStats
from conveyor.engine.args import parse_speculative_config
from conveyor.engine.model_setup import build_engine_core
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams
from conveyor.worker.warmup import compiled_kernel_count


def make_workload(num_requests: int = 256, min_len: int = 100, max_input: int = 1024, max_output: int = 1024,
                  seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """nano256: the peer's draws, in the peer's order."""
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(min_len, max_input))]
               for _ in range(num_requests)]
    out_lens = [random.randint(min_len, max_output) for _ in range(num_requests)]
    return prompts, out_lens


def gemm_backend_field(args: argparse.Namespace) -> dict[str, object]:
    """ModelConfig's gemm_backend, given only when it is not the default: fp8.sh's SRC= trees from before
    the flag (a lever's before) still run."""
    if args.gemm_backend == "torch":
        return {}
    from conveyor.config import GemmBackend

    return {"gemm_backend": GemmBackend(args.gemm_backend)}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=args.model, load_format=LoadFormat.DUMMY, dtype="bfloat16", seed=args.seed,
                          num_hidden_layers_override=args.num_layers, quantization=Quantization(args.quantization),
                          **gemm_backend_field(args)),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.max_model_len, async_scheduling=args.async_scheduling),
        cache=CacheConfig(block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=False, cache_dtype=args.kv_cache_dtype),
        device=DeviceConfig(device=args.device, enforce_eager=args.enforce_eager),
        speculative_config=args.speculative_config,
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size),
    )


@dataclass(frozen=True)
class RunTotals:
    """One timed batch of requests."""

    wall_s: float
    num_tokens: int
    """Output tokens streamed."""
    num_steps: int
    spec_decoding: SpecDecodingStats | None
    """Speculative decoding's counters summed over the steps (None: off, or nothing drafted)."""
    steps: tuple[StepTime, ...]
    """One record a step, in step order."""


@dataclass(frozen=True)
class StepTime:
    """One step of the timed run, for step_gap.py: when it returned, and what the scheduler ran in it.
    Under async scheduling a step returns once the step before it is done on the GPU, so the gaps between
    returns are the GPU's step times in steady state."""

    t_s: float
    """Seconds from the first submission to this step's return."""
    num_running_reqs: int
    num_scheduled_tokens: int
    num_prompt_tokens: int


def run_requests(core, prompts: list[list[int]], params: list[SamplingParams], tag: str) -> RunTotals:
    """Submit all, step to completion."""
    eos = core.limits.eos_token_ids[0] if core.limits.eos_token_ids else None
    start = time.perf_counter()
    for index, (prompt, sp) in enumerate(zip(prompts, params)):
        core.add_request(Request(f"{tag}{index}", list(prompt), sp, time.monotonic(), eos_token_id=eos))
    num_tokens = 0
    spec: SpecDecodingStats | None = None
    steps: list[StepTime] = []
    while core.has_unfinished_requests():
        result = core.step()
        stats = result.stats
        steps.append(StepTime(time.perf_counter() - start, stats.num_running_reqs, stats.num_scheduled_tokens,
                              stats.num_prompt_tokens))
        num_tokens += sum(len(out.new_token_ids) for out in result.outputs)
        if stats.spec_decoding is not None:
            spec = stats.spec_decoding.merged(spec)
    return RunTotals(time.perf_counter() - start, num_tokens, len(steps), spec, tuple(steps))


def spec_fields(args: argparse.Namespace, spec: SpecDecodingStats | None) -> dict:
    """The speculative config and what it accepted, vLLM's way (acceptance, mean acceptance length)."""
    config = args.speculative_config
    if config is None:
        return {"speculative_config": None}
    fields = {"speculative_config": config.to_dict(), "spec_num_drafts": 0, "spec_num_draft_tokens": 0,
              "spec_num_accepted_tokens": 0}
    if spec is not None and spec.num_drafts:
        fields.update(spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
                      spec_num_accepted_tokens=spec.num_accepted_tokens,
                      spec_acceptance_rate=round(spec.num_accepted_tokens / spec.num_draft_tokens, 4),
                      spec_mean_acceptance_length=round(1 + spec.num_accepted_tokens / spec.num_drafts, 3))
    return fields


def profile_steps(core, args: argparse.Namespace) -> dict:
    """torch.profiler over a few steps in the middle of a decode-heavy phase: CPU/GPU time per op."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    prompts, out_lens = make_workload(seed=args.seed)
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n) for n in out_lens]
    eos = core.limits.eos_token_ids[0] if core.limits.eos_token_ids else None
    for index, (prompt, sp) in enumerate(zip(prompts, params)):
        core.add_request(Request(f"prof{index}", list(prompt), sp, time.monotonic(), eos_token_id=eos))
    step_s: list[float] = []
    for _ in range(args.profile_after_steps):  # past the prefills: steady decode at batch 256
        core.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.profile_steps):
            tick = time.perf_counter()
            core.step()
            step_s.append(time.perf_counter() - tick)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    if args.profile_out:
        pathlib.Path(args.profile_out).write_text(table)
        prof.export_chrome_trace(str(pathlib.Path(args.profile_out).with_suffix(".json")))
    while core.has_unfinished_requests():
        core.step()
    return {"profile_step_ms": [round(s * 1e3, 2) for s in step_s]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="directory holding config.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--quantization", default="none", choices=["none", "fp8", "ptpc_fp8"],
                        help="fp8: decoder projections quantized to FP8 at load (vLLM's online FP8)")
    parser.add_argument("--gemm-backend", default="torch", choices=["torch", "triton"],
                        help="triton: the decoder projections call kernels/triton_gemm.py (lever 6; default torch)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                        help="KV cache element type (fp8: twice the blocks, kernels dequantize on read)")
    parser.add_argument("--async-scheduling", action="store_true", help="launch step N+1 before step N's tokens are back")
    parser.add_argument("--speculative-config", type=parse_speculative_config, default=None, metavar="JSON",
                        help="speculative decoding, as conveyor serve takes it (not with --async-scheduling)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=None, help="truncate the model (smoke tests)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the model is split over")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile-steps", type=int, default=0, help="also profile this many steps")
    parser.add_argument("--profile-after-steps", type=int, default=40)
    parser.add_argument("--profile-out", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--step-times-out", default=None,
                        help="write the timed run's steps here, one JSON line each (benchmarks/gpu/step_gap.py)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    # Warnings, and the KV sizing's "Memory profiling: ..." line (weights, peaks, non-torch, blocks), on stderr.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("conveyor.worker.kv_cache").setLevel(logging.INFO)
    t_load = time.perf_counter()
    core = build_engine_core(engine_config(args))
    load_s = time.perf_counter() - t_load
    compiled_at_ready = compiled_kernel_count()
    warm = [[1, 2, 3, 4, 5, 6, 7, 8] * 2, [9, 10, 11, 12] * 4]
    run_requests(core, warm, [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=16)] * 2, "warm")
    prompts, out_lens = make_workload(num_requests=args.num_requests, seed=args.seed)
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n) for n in out_lens]
    compiled_before = compiled_kernel_count()
    timed = run_requests(core, prompts, params, "req")
    wall, got, steps = timed.wall_s, timed.num_tokens, timed.num_steps
    compiles_in_window = compiled_kernel_count() - compiled_before  # > 0: the warm-up missed a variant
    in_tok, out_tok = sum(len(p) for p in prompts), sum(out_lens)
    result = {
        "engine": "conveyor", "model": pathlib.Path(args.model).name,
        "workload": "nano256" if args.num_requests == 256 else f"nano{args.num_requests}",
        "prompt_tokens": in_tok, "output_tokens": out_tok, "output_tokens_generated": got,
        "wall_s": round(wall, 3), "output_tok_s": round(out_tok / wall, 1),
        "total_tok_s": round((in_tok + out_tok) / wall, 1), "num_steps": steps,
        "mean_step_ms": round(wall / steps * 1e3, 3), "load_and_capture_s": round(load_s, 1),
        "compiled_kernels_at_ready": compiled_at_ready, "compiles_in_warmup_requests": compiled_before - compiled_at_ready,
        "compiles_in_timed_window": compiles_in_window,
        "enforce_eager": args.enforce_eager, "async_scheduling": args.async_scheduling,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "num_kv_blocks": core.limits.num_kv_blocks,
        "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization, "gemm_backend": args.gemm_backend,
        "tensor_parallel_size": args.tensor_parallel_size,
        "gpu": _gpu_name(), "versions": _versions(), **spec_fields(args, timed.spec_decoding),
    }
    if args.step_times_out:
        pathlib.Path(args.step_times_out).write_text("".join(json.dumps(asdict(t)) + "\n" for t in timed.steps))
    if args.profile_steps:
        result.update(profile_steps(core, args))
    core.shutdown()
    write_result(result, args.out)
    return 0 if got == out_tok else 1


def write_result(result: dict, out: str | None) -> None:
    """The RESULT line on stdout, and appended to --out if given."""
    line = json.dumps(result)
    print("RESULT " + line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def _versions() -> dict:
    import torch

    versions = {"python": sys.version.split()[0], "torch": torch.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    return versions


if __name__ == "__main__":
    sys.exit(main())
