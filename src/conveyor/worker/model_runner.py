"""The model runner: `SchedulerOutput` (ints) → input tensors → forward → logits → sampled token ids.

One `execute` handles the whole mixed batch at once: prefill chunks (with or without a cached
prefix) and decodes are all "compute tokens [start, start + n) of a sequence", so they share one
flat token axis and one forward pass. Per-request state (tokens, block table, generator) persists
in the worker between steps (request_state.py); the host-side inputs are built with numpy
(input_batch.py); only the requests whose range reaches the end of their known tokens sample, and
only their last hidden rows go through the LM head. With speculative decoding on (spec_decode/), every
step is verified and runs to completion before `launch` returns: the next step's drafts depend on this
one's accepted tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from conveyor.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from conveyor.core.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from conveyor.kernels.cpu_build import cpu_kernels_available
from conveyor.model.loader import LoadedModel, load_model, resolve_dtype
from conveyor.sampling_params import SamplingParams
from conveyor.worker.cuda_graphs import CudaGraphRunner, GraphPlan
from conveyor.worker.gpu_memory import (
    GpuMemoryProfile,
    MemorySnapshot,
    profile_gpu_memory,
    requested_memory_bytes,
    take_memory_snapshot,
)
from conveyor.worker.input_batch import HostBatch, HostStaging, prepare_host_batch
from conveyor.worker.kv_cache import (
    KVCacheSpec,
    KVCapacity,
    SharedBlocksSpec,
    allocate_kv_caches,
    check_fits_max_model_len,
    dtype_num_bytes,
    resolve_kv_cache_dtype,
    resolve_num_blocks,
    sizes_from_gpu_memory_utilization,
)
from conveyor.worker.request_state import BlockTable, RequestState, apply_scheduler_output
from conveyor.worker.sampler import HandedLogits, Sampler
from conveyor.worker.sampling_metadata import (
    SamplingBatch, SamplingRequest, VocabInfo, build_sampling_batch, has_penalty,
)
from conveyor.worker.spec_decode.spec_decoder import ProposerSetup, SpecDecoder, TargetModel, make_proposer
from conveyor.worker.step_handle import StepHandle, fill_placeholders, placeholder_inputs
from conveyor.worker.structured_output import StructuredOutputs
from conveyor.worker.warmup import PROFILE_SAMPLING, max_sampling_rows, profile_sampling_requests, warm_up


def attention_backend_for(device: torch.device, dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> str:
    """The Triton kernels on CUDA with a 16-bit model (its own or an FP8 cache); on CPU in float32 the C
    paged-decode kernel where it builds (a float32 cache only); the torch reference otherwise."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return "triton"
    if device.type == "cpu" and dtype == kv_cache_dtype == torch.float32 and cpu_kernels_available():
        return "cpu"
    return "torch"


class ModelRunner:
    """Owns the model, the KV cache tensors and the worker-side request states."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 device_config: DeviceConfig, speculative_config: SpeculativeConfig | None = None) -> None:
        if device_config.num_threads is not None:
            torch.set_num_threads(device_config.num_threads)
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.device = torch.device(device_config.device)
        self.dtype = resolve_dtype(model_config.dtype, device_config.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(cache_config.cache_dtype, self.dtype)
        """The KV cache tensors' element type (the model's, or FP8 with --kv-cache-dtype fp8)."""
        self.attention_backend = attention_backend_for(self.device, self.dtype, self.kv_cache_dtype)
        self.init_snapshot = self._init_memory_snapshot()
        """The device's memory before the weights load (CUDA only): the KV budget's reference point."""
        loaded = self._load_model(model_config)
        self.model = loaded.module
        self.arch_config = loaded.arch_config
        self.eos_token_ids: tuple[int, ...] = loaded.eos_token_ids
        self.kv_caches: list[torch.Tensor] = []
        self.states: dict[str, RequestState] = {}
        self.staging = HostStaging(self.device)
        self.sampler = Sampler(self._new_generator().manual_seed(model_config.seed))
        self.vocab = VocabInfo(self.vocab_size, frozenset(self.eos_token_ids))
        self.device_config = device_config
        self.cuda_graphs: CudaGraphRunner | None = None
        """Decode and mixed-step graphs, captured after the KV cache exists (CUDA without --enforce-eager)."""
        self._pending: StepHandle | None = None
        """The launched step whose tokens are not collected yet (async scheduling), if any."""
        self.speculative_config = speculative_config
        self.spec_decoder = self._spec_decoder(model_config) if speculative_config is not None else None
        """Verification and the proposer (None: speculative decoding off)."""
        self.structured_outputs: StructuredOutputs | None = None
        """Grammar matchers for structured outputs (set by the engine, which has the tokenizer)."""

    def _init_memory_snapshot(self) -> MemorySnapshot | None:
        """vLLM's worker init snapshot: the device is up (a tensor-parallel rank has picked its GPU), nothing
        loaded yet. What is in use outside torch now, the CUDA context above all, is not charged to the KV
        budget; a start-up that finds less free than --gpu-memory-utilization asks for is refused here,
        before minutes of loading, when that flag sizes the cache."""
        if self.device.type != "cuda":
            return None
        snapshot = take_memory_snapshot(self.device)
        if sizes_from_gpu_memory_utilization(self.cache_config):
            requested_memory_bytes(snapshot, self.cache_config.gpu_memory_utilization)
        return snapshot

    def _profile_gpu_memory(self) -> GpuMemoryProfile:
        assert self.init_snapshot is not None, "CUDA runners take their snapshot before loading"
        return profile_gpu_memory(self.device, self.profile_run, self.init_snapshot)

    def _load_model(self, model_config: ModelConfig) -> LoadedModel:
        """The whole model (a tensor-parallel rank loads its shard: worker/parallel.py)."""
        return load_model(model_config, self.device.type, self.dtype, self.attention_backend)

    def _agree_on_num_blocks(self, num_blocks: int) -> int:
        """The block count every process can hold (one process: its own)."""
        return num_blocks

    def _spec_decoder(self, model_config: ModelConfig) -> SpecDecoder:
        assert self.speculative_config is not None
        setup = ProposerSetup(
            target=model_config, target_vocab_size=self.vocab_size, max_model_len=self.max_model_len,
            block_size=self.block_size, device=self.device, dtype=self.dtype,
            attention_backend=self.attention_backend,
        )
        target = TargetModel(forward=lambda host: self._forward(host, _no_placeholders),
                             lm_head_logits=self.model.lm_head_logits, sampler=self.sampler, vocab=self.vocab,
                             device=self.device, block_size=self.block_size)
        return SpecDecoder(make_proposer(self.speculative_config, setup), target, self._new_generator)

    @property
    def max_model_len(self) -> int:
        """The configured max_model_len capped by the model's positions (what the engine resolves)."""
        return min(self.scheduler_config.max_model_len, self.max_position_embeddings)

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config is not None else 0

    @property
    def vocab_size(self) -> int:
        return self.arch_config.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        """The model's longest position: the engine caps max_model_len with it."""
        return self.arch_config.max_position_embeddings

    @property
    def block_size(self) -> int:
        return self.cache_config.block_size

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(
            num_layers=self.arch_config.num_hidden_layers,
            num_kv_heads=self.model.num_kv_heads,  # this rank's share under tensor parallelism
            head_dim=self.arch_config.head_dim,
            block_size=self.block_size,
            dtype_bytes=dtype_num_bytes(self.kv_cache_dtype),
        )

    def initialize_kv_cache(self) -> KVCapacity:
        """Size the cache (override, memory budget, or GPU profiling) and allocate it; a draft model's
        cache shares the block ids, so each block of the pool costs both."""
        spec = self.kv_cache_spec
        draft_spec = self.spec_decoder.proposer.kv_cache_spec if self.spec_decoder is not None else None
        sizing = SharedBlocksSpec((spec, draft_spec)) if draft_spec is not None else spec
        num_blocks = self._agree_on_num_blocks(resolve_num_blocks(
            sizing, self.cache_config, self.device,
            profile=self._profile_gpu_memory,
        ))
        self.kv_caches = allocate_kv_caches(spec, num_blocks, self.device, self.kv_cache_dtype)
        if self.spec_decoder is not None:
            self.spec_decoder.proposer.bind_kv_cache(num_blocks)
        capacity = KVCapacity(
            num_blocks=num_blocks, block_size=spec.block_size, num_bytes=num_blocks * sizing.bytes_per_block,
            max_model_len=self.max_model_len,
        )
        check_fits_max_model_len(capacity)
        self.cuda_graphs = self._capture_cuda_graphs(capacity.max_model_len)
        warm_up(self)  # every eager kernel variant compiled now, not in the first requests
        return capacity

    def _capture_cuda_graphs(self, max_model_len: int) -> CudaGraphRunner | None:
        if self.device.type != "cuda" or self.device_config.enforce_eager or self.attention_backend != "triton":
            return None
        plan = GraphPlan(
            max_num_seqs=self.scheduler_config.max_num_seqs,
            max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
            max_model_len=max_model_len, block_size=self.block_size, mode=self.device_config.cudagraph_mode,
            max_cudagraph_capture_size=self.device_config.max_cudagraph_capture_size,
            num_speculative_tokens=self.num_speculative_tokens,
        )
        runner = CudaGraphRunner(
            lambda ids, positions, metadata: self.model(ids, positions, self.kv_caches, metadata),
            plan, self.device,
        )
        runner.capture()
        return runner

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step to completion; call it for every SchedulerOutput, even an empty one (it carries drops)."""
        return self.collect(self.launch(scheduler_output))

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Queue the step's forward and sampling on the device and return without waiting for the
        tokens (async scheduling: the engine collects the previous step meanwhile). Placeholder
        input ids -- tokens of the pending step -- are filled from its sampled tensor on the device."""
        batch = apply_scheduler_output(self.states, scheduler_output, self._generator_for)
        if self.structured_outputs is not None:
            self.structured_outputs.drop(scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids)
        if self.spec_decoder is not None:
            self.spec_decoder.drop(scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids)
        elif scheduler_output.scheduled_spec_decode_tokens:
            raise ValueError("the scheduler sent draft tokens but speculative decoding is off in the worker")
        if scheduler_output.is_empty or not batch:
            return StepHandle.done(ModelRunnerOutput(sampled_token_ids={}))
        if not self.kv_caches:
            raise RuntimeError("initialize_kv_cache() must run before execute()")
        if self.spec_decoder is not None:
            return StepHandle.done(self.spec_decoder.execute(batch, scheduler_output))
        if self._pending is not None and any(_reads_history(state.sampling_params) for state in batch):
            self.collect(self._pending)  # penalties and grammars read the real previous token, not its placeholder
        host = prepare_host_batch(batch, scheduler_output.num_scheduled_tokens, self.block_size)
        token_rows, sources = placeholder_inputs(batch, host, self._pending)
        pending = self._pending

        def fill(input_ids: torch.Tensor) -> None:
            if token_rows and pending is not None:
                fill_placeholders(input_ids, token_rows, sources, pending)

        sampling = [batch[row] for row in host.sampling_rows]
        # Sampler inputs are built before the forward is launched: their small host-to-device copies
        # would otherwise queue behind the whole forward.
        sampling_batch = self._sampling_batch(sampling) if sampling else None
        rows = self._forward(host, fill)
        request_ids = [state.request_id for state in batch]
        if sampling_batch is None:
            return StepHandle.done(ModelRunnerOutput(sampled_token_ids={request_id: [] for request_id in request_ids}))
        # [S, V] in the LM head's dtype, handed over: a float32 copy the sampler makes replaces them
        logits = HandedLogits(self.model.lm_head_logits(rows))
        del rows
        if sampling_batch.max_num_logprobs is not None:  # logprobs are read on the host: finish now
            return StepHandle.done(self._sample(sampling, logits, sampling_batch, request_ids))
        return self._launch_sampling(request_ids, sampling, logits, sampling_batch)

    def _forward(self, host: HostBatch, fill: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """Hidden rows [N, H] of host.logits_indices, from a replayed CUDA graph or an eager forward."""
        rows = self.cuda_graphs.run(host, fill) if self.cuda_graphs is not None else None
        if rows is None:
            inputs = self.staging.device_batch(host, self.block_size)
            fill(inputs.input_ids)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attention)  # [T, H]
            rows = hidden[inputs.logits_indices]
        return rows

    def _launch_sampling(self, request_ids: list[str], sampling: list[RequestState], logits: HandedLogits,
                         sampling_batch: SamplingBatch) -> StepHandle:
        sampled = self.sampler.sample(logits, sampling_batch)  # [S] int64, on the device
        handle = StepHandle(request_ids, sampling, [], sampled=sampled)
        if self.device.type == "cuda":
            handle.host_sampled = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
            handle.host_sampled.copy_(sampled, non_blocking=True)
            handle.copied = torch.cuda.Event()
            handle.copied.record()
        for state in sampling:
            state.token_ids.append(PLACEHOLDER_TOKEN_ID)
            handle.token_indices.append(len(state.token_ids) - 1)
        self._pending = handle
        return handle

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        """The step's tokens (waiting for them if needed), written over their placeholders, and the grammar
        failures found since the last collect. Idempotent (a failure is reported once)."""
        result = self._collect_tokens(handle)
        failures = self.structured_outputs.take_failures() if self.structured_outputs is not None else {}
        if failures:
            result = dataclasses.replace(result, grammar_errors={**result.grammar_errors, **failures})
            handle.result = result
        return result

    def _collect_tokens(self, handle: StepHandle) -> ModelRunnerOutput:
        if handle.result is not None:
            return handle.result
        if handle.copied is not None:
            handle.copied.synchronize()
        source = handle.host_sampled if handle.host_sampled is not None else handle.sampled
        assert source is not None
        sampled: dict[str, list[int]] = {request_id: [] for request_id in handle.request_ids}
        for state, index, token_id in zip(handle.sampling, handle.token_indices, source.tolist()):
            state.token_ids[index] = token_id  # also harmless on a state dropped since (preempted)
            sampled[state.request_id] = [token_id]
        handle.result = ModelRunnerOutput(sampled_token_ids=sampled)
        if self._pending is handle:
            self._pending = None
        return handle.result

    def _sampling_batch(self, sampling: list[RequestState]) -> SamplingBatch:
        requests = [SamplingRequest(s.sampling_params, s.token_ids, s.num_prompt_tokens, s.generator)
                    for s in sampling]
        batch = build_sampling_batch(requests, self.vocab, self.device)
        if self.structured_outputs is None:
            return batch
        return dataclasses.replace(batch, grammar=self.structured_outputs.mask(sampling, self.device))

    def _sample(self, sampling: list[RequestState], logits: HandedLogits, sampling_batch: SamplingBatch,
                request_ids: list[str]) -> ModelRunnerOutput:
        result = self.sampler(logits, sampling_batch)
        sampled: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        for state, token_id, token_logprobs in zip(sampling, result.sampled_token_ids, result.logprobs):
            state.token_ids.append(token_id)
            sampled[state.request_id] = [token_id]
            if token_logprobs is not None:
                logprobs[state.request_id] = [token_logprobs]
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _new_generator(self) -> torch.Generator:
        return torch.Generator(device=self.device)

    def _generator_for(self, params: SamplingParams) -> torch.Generator | None:
        """Seeded random requests get their own generator (re-seeded per position by the sampler)."""
        if params.seed is None or params.temperature == 0.0:
            return None
        return self._new_generator()

    @torch.inference_mode()
    def profile_run(self, end_stage: Callable[[], None] = lambda: None) -> int:
        """The largest step the scheduler can send, on scratch KV, for CUDA memory profiling; returns the
        scratch KV's bytes (the profile leaves them out: the real cache is budgeted on its own). `end_stage`
        is called after the forward, the LM head and the sampler (the profile reads each stage's peak)."""
        spec = self.kv_cache_spec
        seq_lens = _split(self.scheduler_config.max_num_batched_tokens, self.max_model_len)
        scratch = allocate_kv_caches(spec, sum(-(-n // spec.block_size) for n in seq_lens), self.device,
                                     self.kv_cache_dtype)
        states, next_block = [], 0
        for index, length in enumerate(seq_lens):
            blocks = list(range(next_block, next_block + -(-length // spec.block_size)))
            next_block += len(blocks)
            states.append(RequestState(f"profile-{index}", [0] * length, length, BlockTable(blocks),
                                       PROFILE_SAMPLING, 0))
        host = prepare_host_batch(states, {s.request_id: len(s.token_ids) for s in states}, spec.block_size)
        inputs = self.staging.device_batch(host, spec.block_size)
        hidden = self.model(inputs.input_ids, inputs.positions, scratch, inputs.attention)
        # Verification samples 1 + K positions per request: the LM head and sampler see that many rows.
        # The sampler's staged path goes through them in row chunks: the peak is the chunked one.
        num_rows = max_sampling_rows(self.scheduler_config, self.num_speculative_tokens)
        sampled_rows = hidden[torch.arange(num_rows, device=self.device) % hidden.shape[0]]
        del hidden  # a real step keeps only its sampled rows past the forward (`_forward`), so does the profile
        end_stage()
        # [num_rows, V] in the LM head's dtype, handed over as `launch` hands them: the call a real step makes
        # (not `compute_logits`, whose float32 copy no step holds beside the LM head's logits). The profile's
        # requests edit their logits (PROFILE_SAMPLING), so the sampler's float32 copy is part of its peak.
        logits = HandedLogits(self.model.lm_head_logits(sampled_rows))
        del sampled_rows
        end_stage()
        self.sampler(logits, build_sampling_batch(profile_sampling_requests(num_rows), self.vocab, self.device))
        end_stage()
        scratch_bytes = sum(t.numel() * t.element_size() for t in scratch)
        del scratch
        return scratch_bytes


def _reads_history(params: SamplingParams) -> bool:
    """Penalties and grammars read the request's previous tokens: a placeholder will not do."""
    return has_penalty(params) or params.structured_output is not None


def _no_placeholders(input_ids: torch.Tensor) -> None:
    """Speculative steps never have placeholder inputs (speculative decoding refuses async scheduling)."""


def _split(num_tokens: int, max_len: int) -> Sequence[int]:
    """num_tokens as sequences of at most max_len tokens."""
    full, rest = divmod(num_tokens, max_len)
    return [max_len] * full + ([rest] if rest else [])
