"""Start-up warm-up: launch every kernel variant the engine can use before the server reports healthy.

Triton compiles a kernel the first time it is launched with a new specialization (its constexprs,
its pointer dtypes, and every integer argument that is 1 or a multiple of 16 unless the kernel marks
it `do_not_specialize`). CUDA graph capture launches, and so compiles, everything that decode and
mixed buckets use. What remains are the eager paths: steps larger than the largest mixed bucket
(every step under `--enforce-eager`), decode batches above the largest decode bucket, the split-KV
reduction at each padded split count, and the sampler's optional stages (top-k/top-p, min-p,
penalties, logprobs, seeded draws), whose CUDA modules load lazily on first use, and its fused
inverse-CDF kernels (kernels/cdf_sample.py), compiled once per logits dtype. Each of them runs
here once, on dummy requests, so that neither a server's first requests nor a benchmark's timed
window wait for a compiler. The sampler also runs once at the full row count of the start-up memory
profile (`profile_sampling_requests`, the profile's own batch), in row chunks as every staged batch:
a reserve the profile got wrong fails here, at start-up, and not under the first full batch. The dummy
steps write garbage into KV block 0, which no request holds yet at start-up; they never touch the
scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from conveyor.config import SchedulerConfig
from conveyor.kernels.paged_batch import PagedBatch
from conveyor.kernels.split_kv_attention import SplitKVParams, split_kv_attention
from conveyor.model.registry import ModelArchConfig
from conveyor.sampling_params import SamplingParams
from conveyor.worker.cuda_graphs import CudaGraphRunner
from conveyor.worker.input_batch import HostStaging, prepare_host_batch
from conveyor.worker.request_state import BlockTable, RequestState
from conveyor.worker.sampler import HandedLogits, Sampler
from conveyor.worker.sampling_metadata import (
    SamplingRequest,
    VocabInfo,
    build_sampling_batch,
)


class WarmupRunner(Protocol):
    """What warm-up reads of a model runner (`worker.model_runner.ModelRunner` is one).
    Declared here so that the runner imports warm-up and warm-up never imports the runner."""

    @property
    def scheduler_config(self) -> SchedulerConfig: ...
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def cuda_graphs(self) -> CudaGraphRunner | None: ...
    @property
    def block_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def staging(self) -> HostStaging: ...
    @property
    def model(self) -> nn.Module: ...
    @property
    def arch_config(self) -> ModelArchConfig: ...
    @property
    def kv_caches(self) -> list[torch.Tensor]: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def attention_backend(self) -> str: ...
    @property
    def sampler(self) -> Sampler: ...
    @property
    def vocab(self) -> VocabInfo: ...
    @property
    def num_speculative_tokens(self) -> int: ...


MAX_SPLITS = 64
"""The split-KV kernel's largest split count (`choose_num_splits` caps it there)."""


@dataclass(frozen=True)
class EagerStep:
    """One dummy step: `num_decodes` one-token requests plus, optionally, one prefill chunk."""

    num_decodes: int
    """Requests computing a single token (decode rows)."""
    prefill_tokens: int
    """Tokens of one prefill chunk in the same step (0: a decode-only step)."""
    context_len: int
    """Tokens each decode request already has in its KV cache."""


def eager_steps(runner: WarmupRunner) -> list[EagerStep]:
    """The eager step shapes this runner's configuration can produce (none beyond what graphs cover)."""
    sched = runner.scheduler_config
    max_len = min(sched.max_model_len, runner.max_position_embeddings)
    graphs = runner.cuda_graphs
    largest_decode = graphs.decode_sizes[-1] if graphs is not None else 0
    largest_mixed = graphs.mixed_sizes[-1] if graphs is not None and graphs.mixed_sizes else 0
    steps: list[EagerStep] = []
    if sched.max_num_seqs > largest_decode:
        # Small batch with a long context (the split-KV kernel) and a full batch (the unified kernel).
        steps.append(EagerStep(num_decodes=1, prefill_tokens=0, context_len=max_len - 1))
        steps.append(EagerStep(num_decodes=sched.max_num_seqs, prefill_tokens=0, context_len=1))
    if sched.max_num_batched_tokens > largest_mixed:
        chunk = min(sched.max_num_batched_tokens - 1, max_len - 1)
        steps.append(EagerStep(num_decodes=1, prefill_tokens=chunk, context_len=1))
    return steps


def _dummy_states(step: EagerStep, block_size: int) -> tuple[list[RequestState], dict[str, int]]:
    """Dummy worker states for `step`, every block id 0 (reads are valid, writes are garbage)."""
    params = SamplingParams(temperature=1.0)
    states: list[RequestState] = []
    for index in range(step.num_decodes):
        length = step.context_len + 1
        table = BlockTable([0] * math.ceil(length / block_size))
        states.append(RequestState(f"warmup-d{index}", [0] * length, length, table, params, step.context_len))
    if step.prefill_tokens:
        table = BlockTable([0] * math.ceil(step.prefill_tokens / block_size))
        states.append(RequestState("warmup-p", [0] * step.prefill_tokens, step.prefill_tokens, table, params, 0))
    scheduled = {s.request_id: len(s.token_ids) - s.num_computed_tokens for s in states}
    return states, scheduled


@torch.inference_mode()
def run_eager_step(runner: WarmupRunner, step: EagerStep) -> None:
    """One dummy forward + LM head of `step`, eagerly, on the runner's real KV cache."""
    states, scheduled = _dummy_states(step, runner.block_size)
    host = prepare_host_batch(states, scheduled, runner.block_size)
    inputs = runner.staging.device_batch(host, runner.block_size)
    hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.attention)  # [T, H]
    runner.model.lm_head_logits(hidden[inputs.logits_indices])  # what a real step calls (no float32 copy)


def sampler_variants() -> list[SamplingParams]:
    """One request per optional stage of the sampler, so each stage's kernels load at start-up."""
    return [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=0.7, seed=1, repetition_penalty=1.1, frequency_penalty=0.2,
                       presence_penalty=0.2),
        SamplingParams(temperature=0.7, logprobs=2),
    ]


@torch.inference_mode()
def warm_up_sampler(runner: WarmupRunner) -> None:
    """Sample a dummy logits batch with every variant mixed in one batch, then each on its own, with
    logits in float32 and in the model's dtype (the LM head's, which the fused kernel reads as it is:
    one compiled variant per dtype)."""
    variants = sampler_variants()
    groups: list[list[SamplingParams]] = [variants, *([params] for params in variants)]
    for dtype in dict.fromkeys((torch.float32, runner.dtype)):
        for group in groups:
            requests = [SamplingRequest(params, [0, 1], 1, _generator_for(runner, params)) for params in group]
            logits = torch.zeros(len(requests), runner.vocab_size, dtype=dtype, device=runner.device)  # [N, V]
            runner.sampler(logits, build_sampling_batch(requests, runner.vocab, runner.device))


PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.1)
"""The memory profile's dummy sampling: the staged path's heaviest variant. Top-p alone sorts the whole
vocabulary (K = V: values and int64 ids per logit) and keeps the shared noise [R, V] for the batch; the
penalty is an edit, and a batch with one edited row needs the float32 copy of every row's logits (4 B/logit
beside the noise), so the profile takes that path: on the unedited one, which reads the bf16 logits, its
peak would be 0.245 GiB below a real full batch with one penalised request (1,024 x 128,256)."""


def max_sampling_rows(scheduler_config: SchedulerConfig, num_speculative_tokens: int) -> int:
    """The most rows one step can hand the sampler: every sequence, each verifying 1 + K positions under
    speculative decoding, at most one per scheduled token."""
    rows = scheduler_config.max_num_seqs * (1 + num_speculative_tokens)
    return min(rows, scheduler_config.max_num_batched_tokens)


def profile_sampling_requests(num_rows: int) -> list[SamplingRequest]:
    """The dummy requests of the profile's sampler step (and of warm-up's full-size one)."""
    return [SamplingRequest(PROFILE_SAMPLING, [0], 1)] * num_rows


@torch.inference_mode()
def warm_up_full_sampler(runner: WarmupRunner) -> None:
    """The profile's sampler step again, at its full row count, on logits in the model's dtype handed over as
    the profile hands them (the float32 copy, the chunked staged path's noise and temporaries are what it
    reserved)."""
    num_rows = max_sampling_rows(runner.scheduler_config, runner.num_speculative_tokens)
    logits = HandedLogits(torch.zeros(num_rows, runner.vocab_size, dtype=runner.dtype, device=runner.device))
    runner.sampler(logits, build_sampling_batch(profile_sampling_requests(num_rows), runner.vocab, runner.device))


def _generator_for(runner: WarmupRunner, params: SamplingParams) -> torch.Generator | None:
    if params.seed is None:
        return None
    return torch.Generator(device=runner.device).manual_seed(params.seed)


def split_counts() -> Iterable[int]:
    """One split count per padded width of the reduction kernel (2, 4, ..., MAX_SPLITS)."""
    count = 2
    while count <= MAX_SPLITS:
        yield count
        count *= 2


@torch.inference_mode()
def warm_up_split_kv(runner: WarmupRunner) -> None:
    """Launch split-KV decode + reduction at every padded split count on a one-request batch."""
    key_cache, value_cache = runner.kv_caches[0][0], runner.kv_caches[0][1]
    num_heads = runner.model.num_heads  # this rank's query heads under tensor parallelism
    head_dim = runner.arch_config.head_dim
    # The model's dtype, not the cache's: an FP8 cache is read by bf16/fp16 queries.
    query = torch.zeros(1, num_heads, head_dim, dtype=runner.dtype, device=runner.device)  # [1, H, d]
    seq_len = runner.block_size * 4
    batch = PagedBatch(
        block_tables=torch.zeros(1, 4, dtype=torch.int32, device=runner.device),
        seq_lens=torch.full((1,), seq_len, dtype=torch.int32, device=runner.device),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=runner.device),
        max_query_len=1, max_seq_len=seq_len,
    )
    head_dim_scale = head_dim ** -0.5
    for num_splits in split_counts():
        split_kv_attention(query, key_cache, value_cache, batch, SplitKVParams(head_dim_scale, num_splits))


def warm_up(runner: WarmupRunner) -> None:
    """Everything above, on CUDA with the Triton backend; a no-op elsewhere (nothing compiles there)."""
    if runner.device.type != "cuda":
        return
    for step in eager_steps(runner):
        run_eager_step(runner, step)
    if runner.attention_backend == "triton":
        warm_up_split_kv(runner)
    warm_up_sampler(runner)
    warm_up_full_sampler(runner)
    torch.cuda.synchronize()


KERNEL_MODULES = ("add_rms_norm", "cdf_sample", "gumbel_sample", "qk_norm_rope", "rms_norm", "rotary",
                  "silu_and_mul", "split_kv_attention", "splitk_linear", "store_kv", "unified_attention")
"""The modules of conveyor.kernels that define Triton kernels."""


def compiled_kernel_count() -> int:
    """Compiled Triton variants of conveyor's kernels held in memory (benchmarks print it around their
    timed window: a count that grows there means a compile the warm-up missed)."""
    import importlib

    total = 0
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"conveyor.kernels.{name}")
        total += sum(_cache_size(value) for value in vars(module).values())
    return total


def _cache_size(fn: object) -> int:
    """Entries across a JITFunction's per-device kernel caches (Triton 3.x: (kernel_cache, key_cache,
    target, backend, binder) per device); 0 for anything else, e.g. the CPU stand-in."""
    device_caches = getattr(fn, "device_caches", None)
    if not isinstance(device_caches, dict):
        return 0
    return sum(len(entry[0]) for entry in device_caches.values())
