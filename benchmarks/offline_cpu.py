"""Offline throughput on this CPU: conveyor (continuous, static) vs Hugging Face transformers `generate`.

Workload: `--num-requests` (64) requests, seeded, with prompt lengths uniform in [20, 600] tokens (random
ordinary token ids) and output lengths uniform in [8, 256], all submitted at once, `ignore_eos` so every
request produces exactly its own length. Metric: useful output tokens per second = the sum of each
request's own output length / wall time from submission to the last completion (model load and one
warm-up excluded). Transformers runs the same requests in submission order, in batches of
`--hf-batch-size` with left padding; each batch generates to its longest member (greedy,
EOS disabled), and only each request's own tokens are counted.

    PYTHONPATH=src python benchmarks/offline_cpu.py            # all three, prints a table + JSON
    PYTHONPATH=src python benchmarks/offline_cpu.py --num-requests 8 --skip-transformers   # smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import time
from dataclasses import asdict, dataclass

import torch

from conveyor.config import ModelConfig
from conveyor.engine.llm import LLM
from conveyor.engine.model_setup import tokenizer_path
from conveyor.sampling_params import SamplingParams

FIRST_ORDINARY_TOKEN_ID = 100
"""SmolLM2's special tokens sit below this id; prompts use ordinary tokens only."""


@dataclass(frozen=True)
class Workload:
    """The requests: prompt token ids and each one's output length."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_useful_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(frozen=True)
class Result:
    """One system's measurement."""

    name: str
    elapsed_s: float
    num_useful_tokens: int
    num_generated_tokens: int
    """Tokens actually computed as outputs (transformers: including padding to the batch's longest)."""
    notes: str = ""

    @property
    def useful_tokens_per_s(self) -> float:
        return self.num_useful_tokens / self.elapsed_s


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    prompts, output_lens = [], []
    for _ in range(args.num_requests):
        length = rng.randint(args.min_prompt_len, args.max_prompt_len)
        prompts.append([rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab_size) for _ in range(length)])
        output_lens.append(rng.randint(args.min_output_len, args.max_output_len))
    return Workload(prompts, output_lens)


def run_conveyor(workload: Workload, batching: str, args: argparse.Namespace) -> Result:
    llm = LLM(batching=batching, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              num_threads=args.num_threads)
    llm.generate([workload.prompts[0][:16]] * 2, SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    start = time.perf_counter()
    results = llm.generate(workload.prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.output_token_ids) for r in results)
    assert produced == workload.num_useful_tokens, "every request must produce exactly its own length"
    summary = llm.last_run
    notes = (f"{summary.num_steps} steps, {summary.num_preemptions} preemptions, "
             f"max running {summary.max_num_running}, max KV use {summary.max_kv_cache_usage:.0%}")
    del llm
    gc.collect()
    return Result(f"conveyor {batching}", elapsed, workload.num_useful_tokens, produced, notes)


def run_transformers(workload: Workload, args: argparse.Namespace) -> Result:
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = tokenizer_path(ModelConfig())
    hf_config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)  # lm_head is tied to the embedding
    model.eval()
    pad_id = 2
    _hf_batch(model, [workload.prompts[0][:16]] * 2, 4, pad_id)  # warm-up
    generated = 0
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), args.hf_batch_size):
        batch = workload.prompts[first:first + args.hf_batch_size]
        longest = max(workload.output_lens[first:first + args.hf_batch_size])
        generated += _hf_batch(model, batch, longest, pad_id) * len(batch)
    elapsed = time.perf_counter() - start
    del model
    gc.collect()
    return Result("transformers generate", elapsed, workload.num_useful_tokens, generated,
                  f"batches of {args.hf_batch_size}, left padding, transformers {transformers.__version__}")


def _hf_batch(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int) -> int:
    """Greedy-generate one left-padded batch for exactly max_new_tokens; return tokens per row."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # [B, width]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, width]
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad_id, eos_token_id=None)
    return out.shape[1] - width


def environment() -> dict[str, str]:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    return {"cpu": cpu, "num_cpus": str(os.cpu_count()), "torch_threads": str(torch.get_num_threads()),
            "python": platform.python_version(), "torch": torch.__version__,
            "load_avg_start": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--min-prompt-len", type=int, default=20)
    parser.add_argument("--max-prompt-len", type=int, default=600)
    parser.add_argument("--min-output-len", type=int, default=8)
    parser.add_argument("--max-output-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--num-threads", type=int, default=1,
                        help="torch threads for both systems (1: the CPU is shared; oversubscribed OpenMP "
                             "threads spin and slow everything down by an order of magnitude)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-static", action="store_true")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.num_threads)
    env = environment()
    workload = make_workload(args, vocab_size=49152)
    results = [run_conveyor(workload, "continuous", args)]
    print(f"partial: {results[-1]}", flush=True)
    if not args.skip_static:
        results.append(run_conveyor(workload, "static", args))
        print(f"partial: {results[-1]}", flush=True)
    if not args.skip_transformers:
        results.append(run_transformers(workload, args))
    env["load_avg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{args.num_requests} requests, {workload.num_useful_tokens} useful output tokens; {env}")
    print(f"{'system':<24}{'time s':>9}{'useful tok/s':>14}{'generated':>11}  notes")
    for r in results:
        print(f"{r.name:<24}{r.elapsed_s:>9.1f}{r.useful_tokens_per_s:>14.1f}{r.num_generated_tokens:>11}  {r.notes}")
    if len(results) == 3:
        print(f"continuous / transformers = {results[0].useful_tokens_per_s / results[2].useful_tokens_per_s:.2f}x; "
              f"continuous / static = {results[0].useful_tokens_per_s / results[1].useful_tokens_per_s:.2f}x")
    print(json.dumps({"env": env, "args": vars(args),
                      "results": [asdict(r) | {"useful_tokens_per_s": r.useful_tokens_per_s} for r in results]}))


if __name__ == "__main__":
    main()
