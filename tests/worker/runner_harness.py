"""Test helpers for the model runner: a tiny dummy Llama and a toy scheduler that builds SchedulerOutputs.

The toy scheduler has unbounded blocks and schedules every unfinished request each step with up to
`chunk_size` tokens; tests use it to compare one-shot, chunked, prefix-hit, batched and preempted runs.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field

import torch

from conveyor.config import (
    CacheConfig,
    DeviceConfig,
    LoadFormat,
    ModelConfig,
    SchedulerConfig,
)
from conveyor.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from conveyor.sampling_params import SamplingParams
from conveyor.worker.model_runner import ModelRunner
from conveyor.worker.sampler import HandedLogits

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
    "bos_token_id": 1,
}
BLOCK_SIZE = 4
TINY_QWEN3 = {**TINY_LLAMA, "architectures": ["Qwen3ForCausalLM"], "head_dim": 16, "tie_word_embeddings": True}
TINY_MODELS = {"llama": TINY_LLAMA, "qwen3": TINY_QWEN3}
MIXED_PROMPTS = {f"r{i}": [(7 * i + 3 * j) % 250 + 3 for j in range(5 + 9 * i)] for i in range(6)}
"""Six prompts of 5-50 tokens: `run_mixed_steps` chunks them so that prefills mix with decodes."""


def write_tiny_llama(directory: pathlib.Path) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA))
    return directory


def make_runner(model_dir: pathlib.Path, num_blocks: int | None = 256, max_model_len: int = 256,
                device: str = "cpu", dtype: str = "auto") -> ModelRunner:
    """A runner on the tiny model; num_blocks=None sizes the cache from memory (30% of a GPU)."""
    runner = ModelRunner(
        ModelConfig(model=str(model_dir), load_format=LoadFormat.DUMMY, seed=0, dtype=dtype),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks_override=num_blocks, gpu_memory_utilization=0.3),
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=max_model_len),
        DeviceConfig(device=device),
    )
    sharpen(runner.model)
    runner.initialize_kv_cache()
    return runner


def sharpen(model: torch.nn.Module) -> None:
    """Larger random weights than the dummy loader's, so most greedy choices are far from ties (not all:
    in bf16 about one position in twenty is within one bf16 step of a tie, fp8_agreement.py)."""
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                std = 0.5 if "embed" in name or "lm_head" in name else 0.1
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def record_logits(runner: ModelRunner) -> list[torch.Tensor]:
    """Wrap the model's lm_head_logits (what the runner samples from) so each call's [S, V] result is
    appended to the returned list."""
    calls: list[torch.Tensor] = []
    original = runner.model.lm_head_logits

    def lm_head_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden)
        calls.append(logits.clone())
        return logits

    runner.model.lm_head_logits = lm_head_logits  # type: ignore[method-assign]
    return calls


@dataclass
class ToyRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    held_by_worker: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def done(self) -> bool:
        return self.params.max_tokens is not None and len(self.output) >= self.params.max_tokens


class ToyScheduler:
    """Schedules every unfinished request every step; fresh blocks from a counter."""

    def __init__(self, chunk_size: int = 1 << 30, first_block: int = 0) -> None:
        self.chunk_size = chunk_size
        self.next_block = first_block
        self.requests: dict[str, ToyRequest] = {}
        self.finished: set[str] = set()
        self.preempted: set[str] = set()

    def add(self, request_id: str, prompt: list[int], params: SamplingParams,
            cached_blocks: list[int] | None = None, num_computed: int = 0) -> ToyRequest:
        request = ToyRequest(request_id, list(prompt), params, block_ids=list(cached_blocks or []),
                             num_computed=num_computed)
        self.requests[request_id] = request
        return request

    def preempt(self, request_id: str) -> None:
        request = self.requests[request_id]
        request.held_by_worker, request.num_computed, request.block_ids = False, 0, []
        self.preempted.add(request_id)

    def _allocate(self, request: ToyRequest, num_tokens: int) -> list[int]:
        needed = -(-(request.num_computed + num_tokens) // BLOCK_SIZE) - len(request.block_ids)
        blocks = list(range(self.next_block, self.next_block + max(0, needed)))
        self.next_block += len(blocks)
        request.block_ids.extend(blocks)
        return blocks

    @staticmethod
    def _place(request: ToyRequest, blocks: list[int], new: list[NewRequestData], cached: CachedRequestData) -> None:
        """List the request among the new ones (sent whole) or the cached ones (sent as what changed)."""
        if request.held_by_worker:
            cached.append(request.request_id, blocks, request.num_computed)
        else:
            new.append(NewRequestData(request.request_id, request.prompt, list(request.output),
                                      request.params, list(request.block_ids), request.num_computed))
            request.held_by_worker = True

    def schedule(self, only: set[str] | None = None) -> SchedulerOutput:
        new, cached, num_tokens = [], CachedRequestData(), {}
        for request in self.requests.values():
            if request.done or (only is not None and request.request_id not in only):
                continue
            n = min(request.num_tokens - request.num_computed, self.chunk_size)
            self._place(request, self._allocate(request, n), new, cached)
            num_tokens[request.request_id] = n
        output = SchedulerOutput(new, cached, num_tokens, sum(num_tokens.values()),
                                 finished_req_ids=self.finished, preempted_req_ids=self.preempted)
        self.finished, self.preempted = set(), set()
        return output

    def step(self, runner: ModelRunner, only: set[str] | None = None) -> dict[str, list[int]]:
        scheduler_output = self.schedule(only)
        result = runner.execute(scheduler_output)
        for request_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            request.num_computed += n
            request.output.extend(result.sampled_token_ids[request_id])
            if request.done:
                self.finished.add(request_id)
        return result.sampled_token_ids

    def run(self, runner: ModelRunner, max_steps: int = 1000) -> dict[str, list[int]]:
        for _ in range(max_steps):
            if all(r.done for r in self.requests.values()):
                break
            self.step(runner)
        return {rid: r.output for rid, r in self.requests.items()}



def force_tokens(runner: ModelRunner, forced: dict[str, list[int]]) -> dict[str, list[torch.Tensor]]:
    """Teacher forcing: each step samples request r's next token of forced[r] whatever the model says
    (two runs then see the same inputs), and the logits [V] it would have sampled from are appended to
    the returned lists, in float32 on the CPU. Prefill, decode and CUDA graphs run as in serving."""
    logits_of: dict[str, list[torch.Tensor]] = {request_id: [] for request_id in forced}
    original = runner._launch_sampling

    def launch_sampling(request_ids, sampling, handed, sampling_batch):  # type: ignore[no-untyped-def]
        logits = handed.take()
        chosen = torch.full_like(logits, -1e4)
        for row, state in enumerate(sampling):
            step = len(logits_of[state.request_id])
            logits_of[state.request_id].append(logits[row].float().cpu())
            chosen[row, forced[state.request_id][step]] = 0.0
        return original(request_ids, sampling, HandedLogits(chosen), sampling_batch)

    runner._launch_sampling = launch_sampling  # type: ignore[method-assign]
    return logits_of


def five_prefill_logits(runner: ModelRunner) -> torch.Tensor:
    """Logits [5, V] (float32) of five prompts' prefills in one step: the same inputs for every model, so two
    models' numerics compare row by row (FP8 against bf16, a stored FP8 checkpoint against online FP8)."""
    runner.initialize_kv_cache()
    calls = record_logits(runner)
    scheduler = ToyScheduler()
    for index in range(5):
        prompt = [(7 * index + 3 * j) % 250 + 3 for j in range(5 + 11 * index)]
        scheduler.add(f"r{index}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    scheduler.step(runner)
    return calls[0].float()


def run_mixed_steps(runner: ModelRunner, forced: dict[str, list[int]] | None = None
                    ) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
    """Every step's sampled logits [S, V] over MIXED_PROMPTS (8 greedy tokens each), chunked so prefills mix with
    decodes, and each request's tokens; `forced`: tokens taken whatever the model says (teacher forcing: another
    run's inputs)."""
    calls = record_logits(runner)
    if forced is not None:
        force_tokens(runner, forced)
    scheduler = ToyScheduler(chunk_size=7)
    for request_id, prompt in MIXED_PROMPTS.items():
        scheduler.add(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    return calls, scheduler.run(runner)
