"""Speculative decoding inside the runner's step: per-position sampling inputs, verification, proposals.

A request verifying K drafts has K + 1 logits rows. Each row is sampled as its own position: a
`SamplingRequest` whose history is the request's tokens plus the drafts before that position (so
penalties and min_tokens see what sequential decoding would have seen), with the seeded generator
of that output position. The sampler then runs unchanged over all rows, `verify_drafts` keeps the
accepted prefix (rejection_sampler.py says why this is exact), and the proposer drafts the next step
from the confirmed tokens. The worker never stores drafts: its token ids hold confirmed tokens only,
and the scheduler's num_computed_tokens (before + scheduled - rejected) says where the next step
starts, so a rejected draft needs no rollback here. A step in which no request verifies a draft (most
steps when lookups find nothing) skips all of that: it samples one row per request exactly as the
runner does without speculation -- the same rows, generators and logprobs that verification would
compute for it -- and only then proposes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import overload

import torch

from conveyor.config import LoadFormat, ModelConfig, SpeculativeConfig, SpeculativeMethod
from conveyor.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from conveyor.model.loader import LoadedModel, ModelNotFoundError, load_model
from conveyor.worker.input_batch import HostBatch, prepare_host_batch
from conveyor.worker.request_state import RequestState
from conveyor.worker.sampler import HandedLogits, Sampler, gather_logprobs, raw_logprobs
from conveyor.worker.sampling_metadata import SamplingBatch, SamplingRequest, VocabInfo, build_sampling_batch
from conveyor.worker.spec_decode.draft_model_proposer import DraftModelProposer, DraftParams
from conveyor.worker.spec_decode.ngram_proposer import NgramParams, NgramProposer
from conveyor.worker.spec_decode.proposer import ProposalInputs, Proposer
from conveyor.worker.spec_decode.rejection_sampler import DraftLayout, draft_layout, verify_drafts


class TokensWithDrafts(Sequence[int]):
    """A request's token ids followed by its first `num_drafts` drafts, without copying the history."""

    def __init__(self, token_ids: list[int], drafts: list[int], num_drafts: int) -> None:
        self._token_ids, self._drafts, self._num_drafts = token_ids, drafts, num_drafts

    def __len__(self) -> int:
        return len(self._token_ids) + self._num_drafts

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return (self._token_ids + self._drafts[: self._num_drafts])[index]  # penalties only: O(L) is fine


@dataclass(frozen=True)
class VerifyPlan:
    """The sampling inputs of one step's verified positions."""

    drafts: list[list[int]]
    """Drafts of each sampling request (empty: a plain sample)."""
    sampling_batch: SamplingBatch
    """One row per verified position, request after request."""
    layout: DraftLayout


@dataclass(frozen=True)
class Verified:
    """What each sampling request keeps: accepted drafts, then the target's token."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None] | None
    """Per request, one entry per kept token (None: the request asked for no logprobs); None as a
    whole when no request did (the usual step: no per-request pass over nothing)."""


@dataclass(frozen=True)
class TargetModel:
    """What a speculative step borrows from the runner."""

    forward: Callable[[HostBatch], torch.Tensor]
    """host -> hidden rows [N, H] of host.logits_indices (a CUDA graph or an eager forward)."""
    lm_head_logits: Callable[[torch.Tensor], torch.Tensor]
    """hidden [N, H] -> logits [N, V] in the LM head's dtype (bf16 on a GPU), as the plain runner hands
    them to the sampler, which makes a float32 copy only where it needs one."""
    sampler: Sampler
    vocab: VocabInfo
    device: torch.device
    block_size: int


class SpecDecoder:
    """The runner's speculative-decoding half: a proposer and the per-position sampling around it."""

    def __init__(self, proposer: Proposer, target: TargetModel, new_generator: Callable[[], torch.Generator]) -> None:
        self.proposer = proposer
        self.target = target
        self._new_generator = new_generator

    def execute(self, batch: list[RequestState], scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One whole step: verify its drafts, append what each request keeps, propose the next drafts."""
        target, drafts = self.target, scheduler_output.scheduled_spec_decode_tokens
        host = prepare_host_batch(batch, scheduler_output.num_scheduled_tokens, target.block_size, drafts)
        sampling = [batch[row] for row in host.sampling_rows]
        # A step without drafts (the usual one when lookups find nothing) samples like plain decoding.
        if any(drafts.values()):
            verified = self.verify_step(host, sampling, drafts)
        else:
            verified = self.plain_step(host, sampling)
        sampled: dict[str, list[int]] = {state.request_id: [] for state in batch}
        for state, tokens in zip(sampling, verified.token_ids):
            state.token_ids.extend(tokens)
            sampled[state.request_id] = tokens
        logprobs: dict[str, list[TokenLogprobs]] = {}
        if verified.logprobs is not None:
            for state, token_logprobs in zip(sampling, verified.logprobs):
                if token_logprobs is not None:
                    logprobs[state.request_id] = token_logprobs
        inputs = ProposalInputs(batch, host.sampling_rows, scheduler_output.num_scheduled_tokens)
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, spec_token_ids=self.propose(inputs))

    def verify_step(self, host: HostBatch, sampling: list[RequestState],
                    spec_tokens: Mapping[str, list[int]]) -> Verified:
        """Forward, then one sampling row per verified position and `verify`."""
        plan = self.plan(sampling, spec_tokens) if sampling else None
        rows = self.target.forward(host)
        if plan is None:
            return Verified([], None)
        return self.verify(self.target.lm_head_logits(rows), plan)  # logits [R, V]

    def plain_step(self, host: HostBatch, sampling: list[RequestState]) -> Verified:
        """A step with no draft: the runner's plain sampling (one row per request, its own generator),
        which is what `verify_step` computes for it, minus the layout and the verification kernels."""
        requests = [SamplingRequest(s.sampling_params, s.token_ids, s.num_prompt_tokens, s.generator)
                    for s in sampling]
        sampling_batch = build_sampling_batch(requests, self.target.vocab, self.target.device) if sampling else None
        rows = self.target.forward(host)  # launched after the sampler inputs' host-to-device copies
        if sampling_batch is None:
            return Verified([], None)
        # logits [S, V], handed over: the sampler's float32 copy, where it makes one, replaces them
        result = self.target.sampler(HandedLogits(self.target.lm_head_logits(rows)), sampling_batch)
        token_ids = [[token_id] for token_id in result.sampled_token_ids]
        if sampling_batch.max_num_logprobs is None:
            return Verified(token_ids, None)
        return Verified(token_ids, [None if entry is None else [entry] for entry in result.logprobs])

    def plan(self, sampling: Sequence[RequestState], spec_tokens: Mapping[str, list[int]]) -> VerifyPlan:
        """One sampling row per verified position of each sampling request, in the layout's order."""
        drafts = [spec_tokens.get(state.request_id, []) for state in sampling]
        requests: list[SamplingRequest] = []
        for state, request_drafts in zip(sampling, drafts):
            generators = self._generators(state, len(request_drafts))
            requests.append(SamplingRequest(state.sampling_params, state.token_ids, state.num_prompt_tokens,
                                            state.generator))
            for position in range(1, len(request_drafts) + 1):
                history = TokensWithDrafts(state.token_ids, request_drafts, position)
                requests.append(SamplingRequest(state.sampling_params, history, state.num_prompt_tokens,
                                                generators[position - 1]))
        device = self.target.device
        return VerifyPlan(drafts, build_sampling_batch(requests, self.target.vocab, device),
                          draft_layout(drafts, device))

    def _generators(self, state: RequestState, num_drafts: int) -> list[torch.Generator | None]:
        """The generators of a request's draft positions 1..num_drafts (None for unseeded requests)."""
        if state.generator is None:
            return [None] * num_drafts
        while len(state.draft_generators) < num_drafts:
            state.draft_generators.append(self._new_generator())
        return list(state.draft_generators[:num_drafts])

    def verify(self, logits: torch.Tensor, plan: VerifyPlan) -> Verified:
        """logits [R, V] of every verified position, in the LM head's dtype (the sampler reads or copies
        them as for plain decoding; modified in place where float32) -> what each request keeps."""
        raw = raw_logprobs(logits, plan.sampling_batch)
        targets = self.target.sampler.sample(logits, plan.sampling_batch)  # [R] on the device
        kept = verify_drafts(targets, plan.layout).to_lists()
        if raw is None:
            return Verified(kept, None)
        per_row = gather_logprobs(raw, targets, plan.sampling_batch.num_logprobs)
        logprobs: list[list[TokenLogprobs] | None] = []
        row = 0
        for tokens, request_drafts in zip(kept, plan.drafts):
            rows = per_row[row : row + len(tokens)]
            logprobs.append(None if rows[0] is None else [r for r in rows if r is not None])
            row += 1 + len(request_drafts)
        return Verified(kept, logprobs)

    def propose(self, inputs: ProposalInputs) -> dict[str, list[int]]:
        """Drafts for the next step of every proposing request that got some."""
        return self.proposer.propose(inputs)

    def drop(self, request_ids: Iterable[str]) -> None:
        self.proposer.drop(request_ids)


@dataclass(frozen=True)
class ProposerSetup:
    """What building a proposer needs to know about the target."""

    target: ModelConfig
    """The target's model config (the draft borrows its dtype, seed and dummy load format)."""
    target_vocab_size: int
    max_model_len: int
    block_size: int
    device: torch.device
    dtype: torch.dtype
    attention_backend: str


def make_proposer(config: SpeculativeConfig, setup: ProposerSetup) -> Proposer:
    """The proposer `config.method` names; a draft model is loaded here (its KV cache comes later)."""
    if config.method is SpeculativeMethod.NGRAM:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        return NgramProposer(NgramParams(min_n=config.prompt_lookup_min, max_n=config.prompt_lookup_max,
                                         num_speculative_tokens=config.num_speculative_tokens,
                                         max_model_len=setup.max_model_len))
    loaded = _load_draft(config, setup)
    params = DraftParams(num_speculative_tokens=config.num_speculative_tokens,
                         max_model_len=setup.max_model_len, block_size=setup.block_size)
    return DraftModelProposer(loaded, params, setup.device, setup.dtype)


def _load_draft(config: SpeculativeConfig, setup: ProposerSetup) -> LoadedModel:
    """The draft model, checked against the target; every error names the speculative_config key."""
    draft_config = ModelConfig(
        model=config.model, dtype=setup.target.dtype, seed=setup.target.seed,
        load_format=LoadFormat.DUMMY if setup.target.load_format is LoadFormat.DUMMY else LoadFormat.AUTO,
        num_hidden_layers_override=config.num_hidden_layers_override,
    )
    try:
        loaded = load_model(draft_config, setup.device.type, setup.dtype, setup.attention_backend)
    except ModelNotFoundError:  # the loader's message names --model, the target's flag
        raise ModelNotFoundError(f"speculative_config: the draft 'model' {config.model!r} does not exist; "
                                 "nothing is downloaded") from None
    if loaded.arch_config.vocab_size != setup.target_vocab_size:
        raise ValueError(f"speculative_config: the draft model {config.model!r} has a vocabulary of "
                         f"{loaded.arch_config.vocab_size} tokens, the target {setup.target_vocab_size}: a draft "
                         "must share the target's tokenizer")
    if loaded.arch_config.max_position_embeddings < setup.max_model_len:
        raise ValueError(f"speculative_config: the draft model {config.model!r} reaches position "
                         f"{loaded.arch_config.max_position_embeddings}, below max_model_len {setup.max_model_len}; "
                         "lower --max-model-len")
    return loaded
