#!/usr/bin/env python3
"""The speed bound of nano256 on this GPU, from measured ceilings, and the fraction a run reaches.

Ceilings (measured here unless given): HBM bandwidth = a large device-to-device copy, bytes read +
written over time; matrix rate = an 8192^3 bf16 matmul on random data. The bound replays nano256 with
all 256 requests resident (as the peer README does): prefill of every prompt at the matrix rate, then one
decode step per output position j = 1..max(out) over the requests still running, each step reading the
weights once plus the K/V of every running request's context. `bytes` bound: HBM time only (the peer's
figure); `bytes+flops`: per step the larger of HBM time and matmul time (2 * params * batch FLOPs),
which matters for Llama-3.1-8B at batch 256.

    python benchmarks/gpu/roofline.py [--measure] [--bandwidth-gb-s 4250 --tflops 790] [--conveyor-json F]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
from dataclasses import dataclass

MODELS = pathlib.Path(__file__).resolve().parents[1] / "models"
PEER_VLLM_OUT_TOK_S = {"qwen3-0.6b": 21787.0, "llama-3.1-8b": 9507.0}
PEER_BOUND_OUT_TOK_S = {"qwen3-0.6b": 35474.0, "llama-3.1-8b": 13284.0}


@dataclass(frozen=True)
class ModelShape:
    """What the bound needs from a config.json."""

    num_params: int
    """Weights read once per decode step (embedding rows excluded unless tied to the LM head)."""
    kv_bytes_per_token: int
    """K and V of one token over all layers, bf16."""
    attn_flops_per_pair: int
    """FLOPs of one (query, key) pair over all layers and heads (QK^T and PV)."""


def model_shape(config: dict) -> ModelShape:
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * config["intermediate_size"]
    lm_head = config["vocab_size"] * hidden
    params = layers * per_layer + lm_head  # the embedding lookup reads only the batch's rows
    return ModelShape(params, 2 * layers * kv_heads * head_dim * 2, 4 * layers * heads * head_dim)


def nano256() -> tuple[list[int], list[int]]:
    """Prompt and output lengths of nano256 (same draws as the peer's make_workload)."""
    random.seed(0)
    prompt_lens = []
    for _ in range(256):
        length = random.randint(100, 1024)
        prompt_lens.append(length)
        for _ in range(length):
            random.randint(0, 10000)
    return prompt_lens, [random.randint(100, 1024) for _ in range(256)]


def bound_s(shape: ModelShape, bandwidth_b_s: float, flop_s: float, with_flops: bool) -> float:
    prompt_lens, out_lens = nano256()
    prefill_flops = sum(2 * shape.num_params * p + shape.attn_flops_per_pair * p * (p + 1) / 2 for p in prompt_lens)
    total = prefill_flops / flop_s
    for step in range(1, max(out_lens) + 1):
        running = [p + step for p, o in zip(prompt_lens, out_lens) if o >= step]
        hbm = (2 * shape.num_params + shape.kv_bytes_per_token * sum(running)) / bandwidth_b_s
        matmul = 2 * shape.num_params * len(running) / flop_s
        total += max(hbm, matmul) if with_flops else hbm
    return total


def measure_ceilings() -> tuple[float, float]:
    import torch
    import triton

    src = torch.randn(2 * 1024**3 // 2, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    bandwidth = 2 * src.numel() * 2 / (ms / 1e3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return bandwidth, 2 * 8192**3 / (ms / 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="measure the ceilings on this GPU")
    parser.add_argument("--bandwidth-gb-s", type=float, default=4250.0)
    parser.add_argument("--tflops", type=float, default=790.0)
    parser.add_argument("--conveyor-json", help="offline.py RESULT lines (JSONL) to compare with the bound")
    args = parser.parse_args()
    bandwidth, flop_s = args.bandwidth_gb_s * 1e9, args.tflops * 1e12
    if args.measure:
        bandwidth, flop_s = measure_ceilings()
    print(f"CEILINGS {json.dumps({'hbm_GB_s': round(bandwidth / 1e9, 1), 'bf16_TFLOP_s': round(flop_s / 1e12, 1)})}")
    measured = {}
    if args.conveyor_json:
        for line in pathlib.Path(args.conveyor_json).read_text().splitlines():
            row = json.loads(line)
            measured[row["model"]] = row["output_tok_s"]
    _, out_lens = nano256()
    for name in ("qwen3-0.6b", "llama-3.1-8b"):
        shape = model_shape(json.loads((MODELS / name / "config.json").read_text()))
        row = {"model": name, "params": shape.num_params, "kv_bytes_per_token": shape.kv_bytes_per_token}
        for label, with_flops in (("bytes", False), ("bytes+flops", True)):
            row[f"bound_out_tok_s[{label}]"] = round(sum(out_lens) / bound_s(shape, bandwidth, flop_s, with_flops))
        row["peer_bound_out_tok_s"] = PEER_BOUND_OUT_TOK_S[name]
        row["vllm_out_tok_s"] = PEER_VLLM_OUT_TOK_S[name]
        if name in measured:
            row["conveyor_out_tok_s"] = measured[name]
            row["conveyor_fraction_of_bound"] = round(measured[name] / row["bound_out_tok_s[bytes]"], 3)
            row["conveyor_fraction_of_vllm"] = round(measured[name] / PEER_VLLM_OUT_TOK_S[name], 3)
        print("ROOFLINE " + json.dumps(row))


if __name__ == "__main__":
    main()
