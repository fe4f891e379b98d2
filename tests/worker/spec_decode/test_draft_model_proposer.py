"""The draft model's passes, planned from host ints: ranges, slots and how many drafts each request gets."""

from __future__ import annotations

from conveyor.sampling_params import SamplingParams
from conveyor.worker.request_state import BlockTable, RequestState
from conveyor.worker.spec_decode.draft_model_proposer import DraftParams, plan_draft_passes
from conveyor.worker.spec_decode.proposer import ProposalInputs

BLOCK = 4


def state(request_id: str, num_tokens: int, num_computed: int, blocks: list[int]) -> RequestState:
    return RequestState(request_id, list(range(10, 10 + num_tokens)), 3, BlockTable(blocks), SamplingParams(),
                        num_computed)


def test_every_request_is_recomputed_from_num_computed_and_samplers_draft() -> None:
    # "d": a decode whose 2 drafts were both accepted (+1 token): tokens 7..9 are new since num_computed 7.
    # "p": a partial prefill chunk [0, 4) of a 9-token prompt: recomputed, no drafts.
    batch = [state("d", 10, 7, [0, 1, 2, 3]), state("p", 9, 0, [5, 6, 7])]
    assert ProposalInputs(batch, [0], {"d": 3, "p": 4}).context_ends == [10, 4]
    passes = plan_draft_passes(ProposalInputs(batch, proposing_rows=[0], num_scheduled_tokens={"d": 3, "p": 4}),
                               DraftParams(num_speculative_tokens=3, max_model_len=100, block_size=BLOCK))
    first = passes.first
    assert first.positions.tolist() == [7, 8, 9, 0, 1, 2, 3]
    assert first.input_ids.tolist() == [17, 18, 19, 10, 11, 12, 13]
    assert first.logits_indices.tolist() == [2] and passes.first_drafters == [0]
    assert passes.counts == [3]  # slots up to 15: drafts fed at 10 and 11
    assert [host.positions.tolist() for host, _ in passes.later] == [[10], [11]]
    assert [host.slot_mapping.tolist() for host, _ in passes.later] == [[2 * BLOCK + 2], [2 * BLOCK + 3]]


def test_slots_and_max_model_len_limit_the_drafts() -> None:
    batch = [state("full", 8, 7, [0, 1]),       # slots end at its context end 8: only e_0 (never fed)
             state("room", 8, 7, [2, 3, 4]),    # slots to 12: e_0 .. e_4, fed at 8 .. 11
             state("short", 9, 7, [9, 10])]     # context end 9 past its 8 slots: computes 7 only, no drafts
    passes = plan_draft_passes(ProposalInputs(batch, proposing_rows=[0, 1, 2],
                                              num_scheduled_tokens={"full": 1, "room": 1, "short": 1}),
                               DraftParams(num_speculative_tokens=5, max_model_len=100, block_size=BLOCK))
    assert passes.counts == [1, 5, 0]
    assert passes.first.seq_lens.tolist() == [8, 8, 8] and passes.first_drafters == [0, 1]
    assert [active for _, active in passes.later] == [[1]] * 4
    capped = plan_draft_passes(ProposalInputs(batch[1:2], proposing_rows=[0], num_scheduled_tokens={"room": 1}),
                               DraftParams(num_speculative_tokens=5, max_model_len=10, block_size=BLOCK))
    assert capped.counts == [2] and len(capped.later) == 1  # drafts at positions 8 and 9 only
