"""Everything that crosses between the API-server process(es) and the engine-core process.

Model: the front ends and the engine core talk over ZeroMQ IPC sockets; every message is one
msgpack frame encoded by msgspec from the types below (vLLM's choice: msgspec decodes straight into
typed objects, an order of magnitude faster than pickle, and refuses anything that does not match).
Inputs go front end -> core on one PULL socket that all front ends PUSH to; outputs go core -> front
end i on its own PUSH socket, one `EngineStepOutputs` per step per front end with news. Start-up is a
separate one-shot handshake (`EngineReady` or `EngineStartupFailed`) to the launching process.

No torch here and nothing that imports it: the API side decodes these without loading the engine.
Only ints, strings and small dataclasses travel: never tensors, never the tokenizer.
"""

from __future__ import annotations

import msgspec

from conveyor.core.outputs import EngineCoreOutput, TokenLogprobs
from conveyor.core.stats import SchedulerStats
from conveyor.core.step_log import StepRecord
from conveyor.engine.types import EngineInfo
from conveyor.request import FinishReason
from conveyor.sampling_params import SamplingParams

# ---- front end -> engine core ---------------------------------------------------------------------


class ClientHello(msgspec.Struct, tag="hello", array_like=True):
    """A front end connected: the core may now send to its output socket."""

    client_index: int


class AddRequest(msgspec.Struct, tag="add", array_like=True, omit_defaults=True):
    """A request the front end admitted (validated, counted, tokenized): the core only queues it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_s: float
    """time.monotonic() in the front end (CLOCK_MONOTONIC is one clock for every process on a host)."""
    client_index: int
    priority: int = 0
    cache_salt: str | None = None


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """End these requests now: ABORT (client gone, shutdown) or STOP (a stop string matched)."""

    request_ids: list[str]
    reason: FinishReason


class ShutdownEngine(msgspec.Struct, tag="shutdown", array_like=True):
    """The launcher's order to stop (after the front ends drained): abort what is left, exit 0."""


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", array_like=True):
    """vLLM's reset_prefix_cache (see EngineCore.reset_prefix_cache); the core answers `PrefixCacheReset`."""

    client_index: int
    token: int
    """Pairs the answer with the call."""
    reset_running_requests: bool = False


class CheckHealth(msgspec.Struct, tag="check_health", array_like=True):
    """Is the core's loop turning? It answers `HealthReply` between two steps, so a stopped or stuck
    process (SIGSTOP, a hung kernel) answers nothing, while a merely busy one answers within a step."""

    client_index: int
    token: int
    """Pairs the answer with the call."""


class DrainStepLog(msgspec.Struct, tag="drain_step_log", array_like=True):
    """Take the step records logged since the last drain (see EngineCore.drain_step_log); the core answers
    `StepLogRecords`."""

    client_index: int
    token: int
    """Pairs the answer with the call."""


EngineInput = (ClientHello | AddRequest | AbortRequests | ShutdownEngine | ResetPrefixCache | CheckHealth
               | DrainStepLog)

# ---- engine core -> front end ---------------------------------------------------------------------


class EngineStepOutputs(msgspec.Struct, tag="step", array_like=True, omit_defaults=True):
    """One step's news for one front end, batched: going-on requests as parallel lists, finished
    ones whole (with their timings), and, for the front end that reports them, the engine's stats."""

    req_ids: list[str] = []
    new_token_ids: list[list[int]] = []
    """Tokens each going-on request kept this step (index i belongs to req_ids[i])."""
    new_logprobs: dict[str, list[TokenLogprobs]] = {}
    finished: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    peak_memory_bytes: int | None = None
    """The engine process's peak device memory: torch.cuda.max_memory_reserved() on CUDA, peak RSS on CPU."""


class EngineDead(msgspec.Struct, tag="dead", array_like=True):
    """The engine core's loop failed (CUDA error, OOM, a bug): it will exit; fail everything."""

    message: str


class PrefixCacheReset(msgspec.Struct, tag="prefix_cache_reset", array_like=True):
    """The answer to ResetPrefixCache: False if requests held KV blocks (nothing was reset)."""

    token: int
    reset: bool


class HealthReply(msgspec.Struct, tag="health_reply", array_like=True):
    """The answer to CheckHealth."""

    token: int


class StepLogRecords(msgspec.Struct, tag="step_log", array_like=True):
    """The answer to DrainStepLog: the records, oldest first; `enabled` False when --step-log-size is 0."""

    token: int
    enabled: bool
    records: list[StepRecord]


EngineOutput = EngineStepOutputs | EngineDead | PrefixCacheReset | HealthReply | StepLogRecords

# ---- start-up handshake (engine core -> launcher) -------------------------------------------------


class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    """The model is loaded and the KV cache allocated; the input and output sockets are bound."""

    info: EngineInfo


class EngineStartupFailed(msgspec.Struct, tag="failed", array_like=True):
    """Start-up raised (bad model path, out of memory, ...): the message is for the user."""

    message: str


EngineHandshake = EngineReady | EngineStartupFailed


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def input_decoder() -> msgspec.msgpack.Decoder[EngineInput]:
    return msgspec.msgpack.Decoder(EngineInput)  # type: ignore[arg-type]


def output_decoder() -> msgspec.msgpack.Decoder[EngineOutput]:
    return msgspec.msgpack.Decoder(EngineOutput)  # type: ignore[arg-type]


def handshake_decoder() -> msgspec.msgpack.Decoder[EngineHandshake]:
    return msgspec.msgpack.Decoder(EngineHandshake)  # type: ignore[arg-type]
