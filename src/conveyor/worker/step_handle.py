"""A launched step whose sampled tokens may still be on the device, and the inputs that wait for them.

Model (async scheduling, see core/async_scheduler.py): `ModelRunner.launch` queues step N's forward
and sampling, appends a placeholder to each sampling request's `token_ids` and returns a `StepHandle`
at once; `collect` waits for the tokens (one pinned device-to-host copy, one event) and writes them
over the placeholders. Step N+1 is launched before step N is collected, so a decode's input id can be
a placeholder: `placeholder_inputs` finds those positions and the rows of step N's sampled tensor
that hold them, and the runner copies them into the input ids on the device before the forward.
Only the step just before can be pending: the engine collects step N before it launches step N+2.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from conveyor.core.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput
from conveyor.worker.input_batch import HostBatch
from conveyor.worker.request_state import RequestState

@dataclass
class StepHandle:
    """One launched step: its batch, where its tokens go, and its output once collected."""

    request_ids: list[str]
    """Every request of the batch (each gets an entry in the output, empty if it did not sample)."""
    sampling: list[RequestState]
    """The requests that sample, in the row order of `sampled`."""
    token_indices: list[int]
    """Index of each sampling request's placeholder in its token_ids."""
    sampled: torch.Tensor | None = None
    """[S] int64 on the model's device."""
    host_sampled: torch.Tensor | None = None
    """[S] int64 pinned copy of `sampled` (CUDA), complete once `copied` has fired."""
    copied: torch.cuda.Event | None = None
    result: ModelRunnerOutput | None = None
    """The output, set when the step is collected (or was complete at launch)."""

    @classmethod
    def done(cls, result: ModelRunnerOutput) -> StepHandle:
        return cls([], [], [], result=result)


def placeholder_inputs(batch: list[RequestState], host: HostBatch,
                       pending: StepHandle | None) -> tuple[list[int], list[int]]:
    """(token rows of this step, rows of the pending step's `sampled`) for every placeholder input."""
    holes = np.flatnonzero(host.input_ids == PLACEHOLDER_TOKEN_ID)
    if holes.size == 0:
        return [], []
    if pending is None or pending.sampled is None:
        raise RuntimeError("a placeholder input id but no pending step to take it from")
    rows = {id(state): row for row, state in enumerate(pending.sampling)}
    request_of_token = np.searchsorted(host.query_start_loc, holes, side="right") - 1
    sources = []
    for token_row, request_row in zip(holes.tolist(), request_of_token.tolist()):
        source = rows.get(id(batch[request_row]))
        if source is None:
            raise RuntimeError(f"request {batch[request_row].request_id!r}: placeholder input at token row "
                               f"{token_row} was not sampled by the pending step")
        sources.append(source)
    return holes.tolist(), sources


def fill_placeholders(input_ids: torch.Tensor, token_rows: list[int], sources: list[int],
                      pending: StepHandle) -> None:
    """input_ids[token_rows] = pending.sampled[sources], on the device, without a host sync."""
    device = input_ids.device
    index = torch.tensor([token_rows, sources], dtype=torch.int64)  # [2, n]
    if device.type == "cuda":
        index = index.pin_memory().to(device, non_blocking=True)
    assert pending.sampled is not None
    input_ids[index[0]] = pending.sampled[index[1]]
