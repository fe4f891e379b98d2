"""`conveyor plan`: weights + KV cache + overhead of a model against the GPU catalog, or (with
`--kv-cache-memory`) the KV capacity `conveyor serve` will report for a given budget."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import sys
from typing import Any

from conveyor.bench.plan.gpu_catalog import CatalogError, parse_prices, priced_catalog
from conveyor.bench.plan.memory import (
    DTYPE_BYTES,
    GPUFit,
    ModelMemory,
    ModelShape,
    PlanError,
    PlanInputs,
    count_parameters,
    fit_on,
    kv_capacity,
    load_shape,
    model_memory,
    shape_per_rank,
)

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}
_GIB = float(1 << 30)


def parse_bytes(text: str) -> int:
    """`1073741824`, `1GiB`, `512MiB`, `2G` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]i?)?b?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected bytes such as 1073741824 or 1GiB (got {text!r})")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = PlanInputs()
    parser.add_argument("--config", required=True, type=pathlib.Path,
                        help="Hugging Face config.json (or a directory holding one)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES),
                        help="weight dtype (default bfloat16; float32 with --kv-cache-memory, as serve on CPU)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", *sorted(DTYPE_BYTES)],
                        help="as serve's flag: auto (default) is --dtype; fp8 halves bf16's KV bytes")
    parser.add_argument("--max-num-seqs", "--concurrency", type=int, default=defaults.max_num_seqs,
                        help="expected concurrent requests")
    parser.add_argument("--context-len", type=int, default=defaults.context_len,
                        help="target context per request (prompt + output), tokens")
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization)
    parser.add_argument("--tensor-parallel-size", type=int, default=defaults.tensor_parallel_size,
                        help="GPUs (ranks) the model is split over; memory figures are per rank")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--quantization", choices=["none", "fp8", "ptpc_fp8"],
                        help="as serve's: fp8 / ptpc_fp8 weights take one byte")
    parser.add_argument("--gpu", action="append", default=[], help="catalog GPU to check (repeatable; default all)")
    parser.add_argument("--price", action="append", default=[],
                        help="GPU=USD_PER_HOUR[,GPU=USD_PER_HOUR] (repeatable) or a JSON/TOML file of them")
    parser.add_argument("--kv-cache-memory", type=parse_bytes,
                        help="KV capacity mode: blocks for this budget, as `conveyor serve` sizes them")
    parser.add_argument("--max-model-len", type=int, default=2048, help="KV capacity mode: request length")
    parser.add_argument("--json", action="store_true", help="print JSON (bytes as integers)")


def run(args: argparse.Namespace) -> int:
    try:
        shape = load_shape(args.config)
        if args.kv_cache_memory is not None:
            return _run_kv_capacity(args, shape)
        inputs = PlanInputs(
            dtype=args.dtype or "bfloat16", kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=args.max_num_seqs,
            context_len=args.context_len, max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
            tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
            quantization=_quantization(args.quantization, shape))
        gpus = priced_catalog(parse_prices(args.price), args.gpu or None)
        memory = model_memory(shape, inputs)
    except (PlanError, CatalogError) as error:
        print(f"conveyor plan: {error}", file=sys.stderr)
        return 2
    fits = [fit_on(g, memory, inputs) for g in gpus]
    if args.json:
        print(json.dumps(_plan_json(args, inputs, memory, fits), indent=2))
    else:
        print(format_plan(str(args.config), inputs, memory, fits))
    return 0


def _quantization(flag: str | None, shape: ModelShape) -> str | None:
    """--quantization, else fp8 for a checkpoint stored in FP8 (as serve loads it); none contradicts it."""
    if shape.stored_fp8 and flag not in (None, "fp8"):
        raise PlanError(f"--quantization {flag} contradicts the checkpoint, which is stored in FP8 "
                        "(config.json quantization_config.quant_method 'fp8'); drop the flag")
    return "fp8" if shape.stored_fp8 else flag


def _run_kv_capacity(args: argparse.Namespace, shape: ModelShape) -> int:
    if args.tensor_parallel_size < 1:
        raise PlanError(f"--tensor-parallel-size must be >= 1 (got {args.tensor_parallel_size})")
    weights = args.dtype or "float32"
    kv_dtype = weights if args.kv_cache_dtype in (None, "auto") else args.kv_cache_dtype
    plan = kv_capacity(shape_per_rank(shape, args.tensor_parallel_size), args.kv_cache_memory, args.block_size,
                       kv_dtype, args.max_model_len)
    if args.json:
        print(json.dumps(dataclasses.asdict(plan), indent=2))
        return 0
    per_rank = f" per rank of {args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    print(f"KV cache{per_rank}: {plan.kv_cache_memory_bytes / _GIB:.2f} GiB / {plan.bytes_per_block} bytes per block "
          f"= {plan.num_blocks} blocks of {plan.block_size} tokens ({plan.num_tokens} tokens); "
          f"max concurrency at {plan.max_model_len} tokens: {plan.max_concurrency:.2f}x")
    return 0


def _plan_json(args: argparse.Namespace, inputs: PlanInputs, memory: ModelMemory, fits: list[GPUFit]) -> dict[str, Any]:
    return {"config": str(args.config), "inputs": dataclasses.asdict(inputs),
            "parameters": dataclasses.asdict(count_parameters(load_shape(args.config))),
            "model": dataclasses.asdict(memory), "gpus": [dataclasses.asdict(f) for f in fits]}


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / _GIB:.2f}"


def format_plan(source: str, inputs: PlanInputs, memory: ModelMemory, fits: list[GPUFit]) -> str:
    kv_token = memory.kv_bytes_per_token
    lines = [
        (f"Model {source}: {memory.num_parameters / 1e9:.3f} B parameters, {inputs.dtype}, "
         f"tensor parallel {inputs.tensor_parallel_size}"),
        f"  weights per GPU    {_gib(memory.weights_bytes)} GiB ({memory.weights_bytes / 1e9:.2f} GB)",
        f"  KV per token       {kv_token} bytes ({kv_token / 1024:.1f} KiB), {inputs.kv_dtype}",
        f"  KV per request     {_gib(memory.kv_bytes_per_request)} GiB at {inputs.context_len} tokens",
        f"  KV needed          {_gib(memory.kv_needed_bytes)} GiB for {inputs.max_num_seqs} concurrent requests",
        (f"  overhead           {_gib(memory.activation_bytes)} GiB activations+logits "
         f"+ {_gib(memory.runtime_bytes)} GiB runtime; margin = 1 - {inputs.gpu_memory_utilization}"),
        "",
        f"{'GPU':<10} {'memory':>8} {'KV budget':>10} {'headroom':>9} {'max conc.':>9} {'fits':>5} {'$/hour':>7}",
    ]
    for f in fits:
        price = "-" if f.price_per_hour is None else f"{f.price_per_hour:.2f}"
        lines.append(f"{f.gpu:<10} {_gib(f.memory_bytes):>8} {_gib(f.kv_budget_bytes):>10} "
                     f"{_gib(f.kv_headroom_bytes):>9} {f.max_concurrency:>9} {'yes' if f.fits else 'NO':>5} "
                     f"{price:>7}")
    lines.append("(GiB; headroom = KV budget - KV needed; max conc. = requests at the target context that fit)")
    return "\n".join(lines)
