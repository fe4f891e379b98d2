"""The body of `AsyncEngine`'s engine thread: drain commands, step, deliver, repeat.

Every iteration first applies all queued commands (add / abort / stop) in submission order, then runs
one `LLMEngine.step()` if any request is live, delivers the outputs and calls the stats listeners.
Blocking: with nothing live it waits on the command queue indefinitely; after a step that scheduled
nothing (requests waiting for room) it waits at most `IDLE_POLL_S`, so queue timeouts still fire.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.engine.llm_engine import EngineStep, LLMEngine, PreparedRequest
from conveyor.engine.types import EngineError, RequestOutput, StatsListener
from conveyor.request import FinishReason

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.05
"""How often the thread wakes while requests wait but nothing could be scheduled."""

Delivery = RequestOutput | tuple[str, BaseException]
"""An output for a request's stream, or (request id, exception to raise in its consumer)."""


class CommandKind(enum.Enum):
    ADD = "add"
    ABORT = "abort"
    STOP = "stop"


@dataclass(frozen=True)
class Command:
    """A request from the event loop to the engine thread."""

    kind: CommandKind
    prepared: PreparedRequest | None = None
    """The request to admit (ADD)."""
    request_ids: list[str] = field(default_factory=list)
    """The requests to end (ABORT)."""


class EngineLoop:
    """Runs on the engine thread; the only code that touches the LLMEngine after start-up."""

    def __init__(self, engine: LLMEngine, commands: queue.SimpleQueue[Command],
                 deliver: Callable[[list[Delivery]], None]) -> None:
        self._engine = engine
        self._commands = commands
        self._deliver = deliver
        self._listeners: list[StatsListener] = []
        self._counts_lock = threading.Lock()
        self._num_waiting = 0  # scheduler's waiting count after the last step
        self._num_undrained = 0  # submitted adds not yet reflected in _num_waiting
        self._num_drained_since_stats = 0
        self._idle = False
        self.stopping = False
        self.error: BaseException | None = None

    def add_stats_listener(self, listener: StatsListener) -> None:
        self._listeners = [*self._listeners, listener]  # copy-on-write: the thread iterates a snapshot

    def note_submitted(self) -> None:
        with self._counts_lock:
            self._num_undrained += 1

    def num_waiting_estimate(self) -> int:
        """Requests waiting for admission: in the scheduler's queue or still in the command queue."""
        with self._counts_lock:
            return self._num_waiting + self._num_undrained

    def run(self) -> None:
        try:
            while not self.stopping:
                self._apply_commands(self._next_commands())
                if not self.stopping and self._engine.has_unfinished_requests():
                    self._step()
            self._end_live_requests()
        except BaseException as error:  # noqa: BLE001 - any failure kills the engine; report it to all
            logger.exception("engine loop crashed")
            self.error = error
            self._fail_everything(error)

    def _next_commands(self) -> list[Command]:
        if not self._engine.has_unfinished_requests():
            commands = [self._commands.get()]
        elif self._idle:
            try:
                commands = [self._commands.get(timeout=IDLE_POLL_S)]
            except queue.Empty:
                commands = []
        else:
            commands = []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply_commands(self, commands: list[Command]) -> None:
        for command in commands:
            if command.kind is CommandKind.STOP:
                self.stopping = True
            elif command.kind is CommandKind.ABORT:
                self._engine.abort(command.request_ids)
            elif command.prepared is not None:
                self._add(command.prepared)

    def _add(self, prepared: PreparedRequest) -> None:
        with self._counts_lock:
            self._num_drained_since_stats += 1
        try:
            self._engine.add_request(prepared)
        except EngineError as error:
            self._deliver([(prepared.request_id, error)])

    def _step(self) -> None:
        step = self._engine.step()
        self._idle = step.stats.num_scheduled_tokens == 0
        with self._counts_lock:
            self._num_waiting = step.stats.num_waiting_reqs
            self._num_undrained -= self._num_drained_since_stats
            self._num_drained_since_stats = 0
        if step.request_outputs:
            self._deliver(list(step.request_outputs))
        self._notify(step)

    def _notify(self, step: EngineStep) -> None:
        for listener in self._listeners:
            try:
                listener(step.stats, step.finished_stats)
            except Exception:  # noqa: BLE001 - a broken listener must not stop serving
                logger.exception("stats listener failed")

    def _end_live_requests(self) -> None:
        """Clean stop: abort what is live, deliver the final outputs, refuse what was never admitted."""
        self._engine.abort(self._engine.live_request_ids())
        outputs = self._engine.take_pending_outputs()
        self._deliver([*outputs, *self._refuse_queued("the engine was shut down before this request started")])

    def _fail_everything(self, error: BaseException) -> None:
        message = f"the engine failed while running this request: {error!r}"
        try:
            outputs: list[Delivery] = list(self._engine.fail_all(message))
        except Exception:  # noqa: BLE001 - keep going: the streams must still be ended
            outputs = []
        outputs.extend(self._refuse_queued(message))
        self._deliver(outputs)

    def _refuse_queued(self, message: str) -> list[Delivery]:
        """Requests submitted but never drained: a final ERROR output each."""
        refused: list[Delivery] = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return refused
            if command.kind is CommandKind.ADD and command.prepared is not None:
                refused.append(error_output(command.prepared.request_id, message))


def error_output(request_id: str, message: str) -> RequestOutput:
    """A final ERROR output for a request the engine can no longer serve."""
    return RequestOutput(request_id=request_id, new_text="", new_token_ids=[], num_prompt_tokens=0,
                         num_output_tokens=0, finish_reason=FinishReason.ERROR, error_message=message)
