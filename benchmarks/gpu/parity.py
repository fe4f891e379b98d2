#!/usr/bin/env python3
"""Model-level check of the triton attention backend against the torch one on the GPU (dummy weights).

Loads a model (default Qwen3-0.6B shape, truncated to --layers) in bf16 on CUDA, runs the same steps
through both backends on fresh zeroed KV caches -- a prefill of three prompts, then a mixed step
(a decode, a continued chunk, a decode), then --decode-steps greedy decode steps fed with each
backend's own argmax -- and reports the logits' relative error per step and whether the greedy
tokens agree. Also times one eager forward per backend at decode batch 256.

    python benchmarks/gpu/parity.py [--model benchmarks/models/qwen3-0.6b] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

from conveyor.config import LoadFormat, ModelConfig
from conveyor.model.attention import get_attention_backend
from conveyor.model.attention_metadata import SequenceSpec, build_attention_metadata, positions_of
from conveyor.model.loader import load_model

BLOCK_SIZE = 16
MODELS = pathlib.Path(__file__).resolve().parents[1] / "models"


def run_steps(model, backend_name: str, prompts: list[list[int]], num_decode_steps: int) -> dict:
    model.set_attention_backend(get_attention_backend(backend_name))
    cfg = model.config
    caches = [torch.zeros(2, 256, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim, device="cuda",
                          dtype=torch.bfloat16) for _ in range(cfg.num_hidden_layers)]
    tables = [list(range(i * 80, i * 80 + 80)) for i in range(len(prompts))]
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)
    all_logits, greedy = [], []
    first_chunk = [len(t) - (10 if i == 1 else 0) for i, t in enumerate(tokens)]  # seq 1 is chunked
    plan = [first_chunk, [1, 10, 1]] + [[1, 1, 1]] * num_decode_steps
    for query_lens in plan:
        seqs = [SequenceSpec(q, done[i] + q, tables[i]) for i, q in enumerate(query_lens)]
        meta = build_attention_metadata(seqs, BLOCK_SIZE, "cuda")
        ids = torch.tensor([t for i, q in enumerate(query_lens) for t in tokens[i][done[i]: done[i] + q]],
                           device="cuda")
        hidden = model(ids, positions_of(meta).cuda(), caches, meta)
        last = meta.query_start_loc[1:].long() - 1
        logits = model.compute_logits(hidden[last])  # [3, V]
        all_logits.append(logits)
        for i, q in enumerate(query_lens):
            done[i] += q
        next_ids = logits.argmax(-1).tolist()
        greedy.append(next_ids)
        for i, token in enumerate(next_ids):
            if done[i] == len(tokens[i]):  # a partial chunk samples nothing
                tokens[i].append(token)
    return {"logits": all_logits, "greedy": greedy}


def time_decode(model, backend_name: str, batch: int, context: int) -> float:
    model.set_attention_backend(get_attention_backend(backend_name))
    cfg = model.config
    blocks_per_seq = context // BLOCK_SIZE + 1
    caches = [torch.zeros(2, batch * blocks_per_seq, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim,
                          device="cuda", dtype=torch.bfloat16) for _ in range(cfg.num_hidden_layers)]
    seqs = [SequenceSpec(1, context, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
            for i in range(batch)]
    meta = build_attention_metadata(seqs, BLOCK_SIZE, "cuda")
    ids = torch.randint(0, 1000, (batch,), device="cuda")
    positions = positions_of(meta).cuda()
    for _ in range(3):
        model(ids, positions, caches, meta)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        model(ids, positions, caches, meta)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 10 * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(MODELS / "qwen3-0.6b"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--decode-steps", type=int, default=16)
    args = parser.parse_args()
    config = ModelConfig(model=args.model, load_format=LoadFormat.DUMMY, dtype="bfloat16",
                         num_hidden_layers_override=args.layers)
    model = load_model(config, "cuda", torch.bfloat16, "torch").module
    prompts = [list(range(3, 40)), [(7 * i) % 5000 for i in range(100)], [11, 12, 13, 14, 15]]
    with torch.inference_mode():
        ref = run_steps(model, "torch", prompts, args.decode_steps)
        out = run_steps(model, "triton", prompts, args.decode_steps)
        errors = [float((a - b).norm() / b.norm()) for a, b in zip(out["logits"], ref["logits"])]
        first = [i for i, (a, b) in enumerate(zip(out["greedy"], ref["greedy"])) if a != b]
        timing = {name: round(time_decode(model, name, 256, 1024), 3) for name in ("torch", "triton")}
    print("PARITY " + json.dumps({
        "model": pathlib.Path(args.model).name, "layers": args.layers, "max_logits_rel_err": max(errors),
        "rel_err_per_step": [round(e, 5) for e in errors], "greedy_equal": not first,
        "first_greedy_mismatch_step": first[0] if first else None,
        "eager_decode_forward_ms_b256_ctx1024": timing,
    }))


if __name__ == "__main__":
    main()
