"""Incremental detokenization of one request: token ids in, text increments and stop strings out.

The model: text is never built by decoding tokens one at a time (byte-level BPE splits characters
across tokens, and some tokenizers change spacing depending on the neighbour). Instead we keep two
offsets into the token list, as vLLM does: `prefix_offset` (start of a short context window) and
`read_offset` (end of what was already emitted). Each step decodes window[prefix:] and window
[prefix:read]; the difference is the new text. While the decoded tail ends in U+FFFD (an incomplete
UTF-8 sequence), nothing is emitted and the offsets do not move, so the character comes out whole once
its last byte arrives. At finish, whatever is left is flushed as the tokenizer decodes it.

Stop strings are searched only in the new text plus the `len(longest stop) - 1` characters before it.
While streaming, that many trailing characters are held back (unless `include_stop_str_in_output`) so
that a prefix of a stop string is never sent and then retracted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from conveyor.sampling_params import SamplingParams

INITIAL_CONTEXT_TOKENS = 5
"""Prompt tokens decoded as left context of the first output token (spacing depends on them)."""

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """What the detokenizer needs from a tokenizer."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class DetokenizerUpdate:
    """The result of feeding new tokens."""

    new_text: str
    """Text to send now (held-back characters excluded)."""
    stop_string: str | None = None
    """The stop string that matched: the caller must finish the request with FinishReason.STOP."""
    num_tokens_consumed: int = 0
    """How many of the fed tokens were used (tokens after a stop-string match are dropped)."""


class IncrementalDetokenizer:
    """Per-request detokenizer state; `update` is called with each step's new token ids."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        longest = max((len(s) for s in params.stop), default=0)
        self._stop_window = max(longest - 1, 0)
        self._hold_back = 0 if self._include_stop else self._stop_window
        context = prompt_token_ids[-INITIAL_CONTEXT_TOKENS:]
        self._token_ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_text = ""
        """All output text decoded so far (after stop-string truncation)."""
        self._num_sent_chars = 0

    def update(self, new_token_ids: list[int], finished: bool) -> DetokenizerUpdate:
        """Append tokens; return the text that may be sent now and any stop string that matched."""
        for index, token_id in enumerate(new_token_ids):
            self._token_ids.append(token_id)
            new_chars = self._decode_step()
            stop = self._check_stop(new_chars) if new_chars else None
            if stop is not None:
                return DetokenizerUpdate(self._take_text(final=True), stop, index + 1)
        if finished:
            self._flush()
        return DetokenizerUpdate(self._take_text(final=finished), None, len(new_token_ids))

    def _decode_step(self) -> int:
        """Decode the window; append new complete text to output_text; return characters added."""
        ids = self._token_ids
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return 0  # incomplete character (or nothing visible yet): wait for more tokens
        new_text = full_text[len(prefix_text):]
        self.output_text += new_text
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return len(new_text)

    def _flush(self) -> None:
        """At finish: emit what is left even if it is an incomplete character (decoded as U+FFFD)."""
        if self._read_offset >= len(self._token_ids):
            return
        prefix_text = self._decode(self._token_ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset:])
        self.output_text += full_text[len(prefix_text):]
        self._read_offset = len(self._token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _check_stop(self, num_new_chars: int) -> str | None:
        """Search the new text (plus a window before it) for a stop string; truncate on a match."""
        if not self._stop:
            return None
        start = max(len(self.output_text) - num_new_chars - self._stop_window, 0)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            position = self.output_text.find(stop, start)
            if position != -1 and (best is None or position < best[0]):
                best = (position, stop)
        if best is None:
            return None
        position, stop = best
        end = position + len(stop) if self._include_stop else position
        self.output_text = self.output_text[:end]
        return stop

    def _take_text(self, final: bool) -> str:
        """The unsent part of output_text, keeping the stop-string window back unless final."""
        limit = len(self.output_text) if final else max(len(self.output_text) - self._hold_back, 0)
        limit = max(limit, self._num_sent_chars)
        text = self.output_text[self._num_sent_chars:limit]
        self._num_sent_chars = limit
        return text
