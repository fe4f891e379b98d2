"""Session turns: what turn k of a conversation is sent with, built from the answers actually received.

A session (traces.dispatch_units) is a chain. Turn k is sent only after turn k−1 has ended (whatever its
outcome), plus the turn's think time, and it carries the whole conversation so far: every earlier
turn's input followed by the answer the server really streamed, then this turn's own input. So each
turn's prompt begins with the previous turn's complete prompt and answer, which is what real chat and
agent clients resend and the prefix cache's best case. On the chat endpoint (or for turns given as
`messages`) the history is a message list (user/assistant alternating after any system message); a
completions turn given as `prompt` extends the previous prompt text by its answer and the new input.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from conveyor.bench.load.client import Endpoint, RequestRecord
from conveyor.bench.trace.traces import TraceRequest

TEXT_SEPARATOR = "\n"
"""Between a completions turn's answer and the next turn's input."""


@dataclass
class History:
    """The conversation of one session so far, in both shapes a turn may need."""

    endpoint: Endpoint
    """Where the turns go: the chat endpoint always sends messages."""
    messages: list[dict[str, str]] = field(default_factory=list)
    """Earlier inputs and answers as chat messages."""
    text: str = ""
    """Earlier prompts and answers as one completions prompt."""
    num_tokens: int = 0
    """Tokens of the history, from the last turn's usage (prompt + output)."""

    def request_for(self, turn: TraceRequest) -> TraceRequest:
        """The turn as sent: the history, then the turn's own input."""
        prompt_len = self.num_tokens + turn.prompt_len
        if self.endpoint is Endpoint.CHAT or turn.messages is not None:
            return dataclasses.replace(turn, prompt=None, messages=self.messages + _own_messages(turn),
                                       prompt_len=prompt_len)
        return dataclasses.replace(turn, prompt=self.text + str(turn.prompt), prompt_len=prompt_len)

    def add(self, turn: TraceRequest, rec: RequestRecord, answer: str) -> None:
        """Append the turn's input and the answer received (empty if it failed before any text)."""
        self.messages = self.messages + _own_messages(turn) + [{"role": "assistant", "content": answer}]
        own_text = turn.prompt if turn.prompt is not None else "\n".join(m["content"] for m in turn.messages or [])
        self.text = self.text + own_text + answer + TEXT_SEPARATOR
        self.num_tokens = rec.prompt_tokens + rec.output_tokens


def _own_messages(turn: TraceRequest) -> list[dict[str, str]]:
    if turn.messages is not None:
        return list(turn.messages)
    return [{"role": "user", "content": str(turn.prompt)}]
