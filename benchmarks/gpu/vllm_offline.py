#!/usr/bin/env python3
"""vLLM offline on nano256 at a tensor-parallel size: the peer's measurement (../shared/peers/h200/bench_offline.py,
`run_vllm`) with `tensor_parallel_size` added, for the two-GPU comparison of benchmarks/gpu/tp.sh.

Same workload (benchmarks/gpu/offline.py's `make_workload`, the peer's draws in the peer's order), same engine
arguments (dummy bf16 weights, no tokenizer, max_model_len 4096, gpu_memory_utilization 0.9, seed 0, vLLM's own
defaults otherwise), the same 2-request warm-up and the same timed window (submission of all 256 to the last
completion). Needs vLLM importable (its site on PYTHONPATH, as session.sh sets it up):

    PYTHONPATH=src:/tmp/site python3 benchmarks/gpu/vllm_offline.py --model benchmarks/models/llama-3.1-70b \\
        --tensor-parallel-size 2 --out results.jsonl
    PYTHONPATH=src:/tmp/site python3 benchmarks/gpu/vllm_offline.py --model benchmarks/models/llama-3.1-8b \\
        --quantization fp8 --kv-cache-dtype fp8      # issue 37: vLLM's own FP8 flags, beside conveyor's

Prints one JSON line ("RESULT {...}") and appends it to --out if given.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from offline import make_workload  # noqa: E402 - the same draws as conveyor's run

WARMUP = ([[1, 2, 3, 4, 5, 6, 7, 8] * 2, [9, 10, 11, 12] * 4], [16, 16])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="directory holding config.json")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantization", default=None, choices=[None, "fp8"], help="vLLM's online dynamic FP8 weights")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, dtype="bfloat16", seed=args.seed,
              tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    load_s = time.perf_counter() - started

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n, detokenize=False)

    llm.generate([TokensPrompt(prompt_token_ids=p) for p in WARMUP[0]], [params(n) for n in WARMUP[1]], use_tqdm=False)
    prompts, out_lens = make_workload(seed=args.seed)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    tick = time.perf_counter()
    outputs = llm.generate(requests, [params(n) for n in out_lens], use_tqdm=False)
    wall = time.perf_counter() - tick
    got = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tok, out_tok = sum(len(p) for p in prompts), sum(out_lens)
    config = llm.llm_engine.vllm_config
    result = {"engine": "vllm", "vllm_version": vllm.__version__, "model": pathlib.Path(args.model).name,
              "workload": "nano256", "tensor_parallel_size": args.tensor_parallel_size, "prompt_tokens": in_tok,
              "quantization": args.quantization or "none", "kv_cache_dtype": args.kv_cache_dtype,
              "output_tokens": out_tok, "output_tokens_generated": got, "wall_s": round(wall, 3),
              "output_tok_s": round(out_tok / wall, 1), "total_tok_s": round((in_tok + out_tok) / wall, 1),
              "load_and_capture_s": round(load_s, 1), "num_gpu_blocks": config.cache_config.num_gpu_blocks,
              "max_num_seqs": config.scheduler_config.max_num_seqs,
              "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens}
    line = json.dumps(result)
    print("RESULT " + line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0 if got == out_tok else 1


if __name__ == "__main__":
    sys.exit(main())
