#!/usr/bin/env python3
"""Real weights on the GPU: conveyor's greedy tokens against Hugging Face transformers, on CUDA.

The embedded SmolLM2-135M-Instruct GGUF is loaded twice: by transformers (its own GGUF dequantizer,
float32 and bfloat16, eager attention) and by conveyor's `LLM` (float32: torch attention backend, no
graphs; bfloat16: Triton kernels, CUDA graphs, the serving defaults). Sixteen prompts (plain text and
chat-templated), greedy, `--max-tokens` tokens each with EOS ignored, so every position compares.

Reported: float32 -- prompts whose conveyor tokens equal transformers' exactly (goal >= 15 of 16);
bfloat16 -- per prompt, the first position where conveyor-bf16 leaves transformers-fp32, against the
first position where transformers-bf16 itself leaves transformers-fp32 (goal: ours no earlier, on
the median and prompt by prompt).

`--fp8` adds issue 37's runs: conveyor bfloat16 with FP8 weights (`--quantization fp8`: the GGUF is
dequantized to bf16, then its projections quantized as vLLM's online fp8 does), with an FP8 KV cache
(`--kv-cache-dtype fp8`), with both, and with per-channel / per-token FP8 weights (`ptpc_fp8`). Each reports its first divergence from transformers float32,
beside bf16's (the same statistics), and from conveyor bf16 itself, with the tokens that agree.

    PYTHONPATH=src python benchmarks/gpu/real_weights.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf [--fp8]

Prints one JSON line ("RESULT {...}") and appends it to --out if given.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import statistics
import sys

import torch

from conveyor.engine.llm import LLM
from conveyor.engine.tokenizer import Tokenizer
from conveyor.sampling_params import SamplingParams

TEXT_PROMPTS = [
    "The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
    "The three laws of thermodynamics are", "SELECT name, email FROM users WHERE", "In 1969, the first",
    "A recipe for pancakes:\n1.", "The difference between TCP and UDP is",
]
CHAT_PROMPTS = [
    "Write a haiku about continuous batching.", "List three prime numbers.",
    "Explain what a KV cache is in one sentence.", "Translate 'good morning' into Spanish and French.",
    "What is 17 times 23?", "Give me a short packing list for a weekend hike.",
    "Summarize the plot of Hamlet in two sentences.", "Name two sorting algorithms and their complexity.",
]


def prompt_ids(gguf: pathlib.Path) -> list[list[int]]:
    tokenizer = Tokenizer.from_gguf(gguf)
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
             for c in CHAT_PROMPTS]
    return [tokenizer.encode(text) for text in [*TEXT_PROMPTS, *chats]]


def _unshadow_hf_kernels() -> None:
    """This folder's kernels.py would shadow the `kernels` package transformers probes for on import."""
    here = str(pathlib.Path(__file__).resolve().parent)
    sys.path[:] = [entry for entry in sys.path if str(pathlib.Path(entry or ".").resolve()) != here]


def hf_greedy(gguf: pathlib.Path, prompts: list[list[int]], dtype: torch.dtype, args: argparse.Namespace) -> list[list[int]]:
    """transformers' own GGUF loading and generate(), on CUDA."""
    _unshadow_hf_kernels()
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)  # lm_head is tied to the embedding
    model = model.to(device=args.device, dtype=dtype).eval()
    outputs = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids], device=args.device),
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=args.device),
                                 max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False,
                                 pad_token_id=2, eos_token_id=None)
        outputs.append(out[0, len(ids):].tolist())
    del model
    _free()
    return outputs


def conveyor_greedy(gguf: pathlib.Path, prompts: list[list[int]], dtype: str, args: argparse.Namespace,
                    quantization: str = "none", kv_cache_dtype: str = "auto") -> list[list[int]]:
    llm = LLM(model=str(gguf), device=args.device, dtype=dtype, max_model_len=1024, kv_cache_memory_bytes=1 << 30,
              quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    tokens = [result.output_token_ids for result in llm.generate(prompts, params)]
    del llm
    _free()
    return tokens


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (len when identical)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(args: argparse.Namespace) -> dict[str, object]:
    gguf = pathlib.Path(args.gguf)
    prompts = prompt_ids(gguf)
    hf32 = hf_greedy(gguf, prompts, torch.float32, args)
    hf16 = hf_greedy(gguf, prompts, torch.bfloat16, args)
    ours32 = conveyor_greedy(gguf, prompts, "float32", args)
    ours16 = conveyor_greedy(gguf, prompts, "bfloat16", args)
    ours16_div = [first_divergence(o, h) for o, h in zip(ours16, hf32)]
    hf16_div = [first_divergence(o, h) for o, h in zip(hf16, hf32)]
    return {
        "num_prompts": len(prompts), "max_tokens": args.max_tokens,
        "fp32_identical_prompts": sum(o == h for o, h in zip(ours32, hf32)),
        "fp32_first_divergence": [first_divergence(o, h) for o, h in zip(ours32, hf32)],
        "bf16_ours_vs_hf32_first_divergence": ours16_div, "bf16_hf_vs_hf32_first_divergence": hf16_div,
        "bf16_median_ours": statistics.median(ours16_div), "bf16_median_hf": statistics.median(hf16_div),
        "bf16_prompts_ours_not_earlier": sum(o >= h for o, h in zip(ours16_div, hf16_div)),
        **(fp8_runs(gguf, prompts, hf32, ours16, args) if args.fp8 else {}),
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
        "torch": torch.__version__,
    }


FP8_RUNS = {"fp8_weights": ("fp8", "auto"), "fp8_kv": ("none", "fp8"), "fp8_both": ("fp8", "fp8"),
            "ptpc_fp8_weights": ("ptpc_fp8", "auto")}
"""name -> (--quantization, --kv-cache-dtype), each on top of conveyor bfloat16."""


def fp8_runs(gguf: pathlib.Path, prompts: list[list[int]], hf32: list[list[int]], ours16: list[list[int]],
             args: argparse.Namespace) -> dict[str, object]:
    """Per FP8 run: first divergence from transformers fp32 (per prompt, median, prompts no earlier than
    bf16's) and from conveyor bf16, and the fraction of all tokens equal to bf16's."""
    ours16_div = [first_divergence(o, h) for o, h in zip(ours16, hf32)]
    result: dict[str, object] = {}
    for name, (quantization, kv_cache_dtype) in FP8_RUNS.items():
        tokens = conveyor_greedy(gguf, prompts, "bfloat16", args, quantization, kv_cache_dtype)
        vs_hf32 = [first_divergence(o, h) for o, h in zip(tokens, hf32)]
        vs_bf16 = [first_divergence(o, b) for o, b in zip(tokens, ours16)]
        equal = sum(x == y for o, b in zip(tokens, ours16) for x, y in zip(o, b))
        result |= {
            f"{name}_vs_hf32_first_divergence": vs_hf32, f"{name}_median_vs_hf32": statistics.median(vs_hf32),
            f"{name}_prompts_not_earlier_than_bf16": sum(f >= b for f, b in zip(vs_hf32, ours16_div)),
            f"{name}_vs_bf16_first_divergence": vs_bf16, f"{name}_median_vs_bf16": statistics.median(vs_bf16),
            f"{name}_identical_to_bf16": sum(o == b for o, b in zip(tokens, ours16)),
            f"{name}_tokens_equal_to_bf16": equal / sum(len(b) for b in ours16),
        }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda", help="cpu for a dry run of the script")
    parser.add_argument("--fp8", action="store_true", help="add FP8 weights / KV cache / both against bf16 (CUDA)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = compare(args)
    line = json.dumps(result)
    print("RESULT " + line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
