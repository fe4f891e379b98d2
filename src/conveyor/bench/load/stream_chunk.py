"""The OpenAI streaming chunk as the client reads it: the keys it uses, typed where the JSON is parsed.

The client (client.py) annotates each parsed SSE payload as a StreamChunk, so mypy checks every key and
type the timing code reads. A TypedDict, not a dataclass: the view costs nothing per chunk, where
building a record measured +0.3 to 0.5 us on a ~1 us parse, on the per-token path that caps what one
load generator offers.
"""

from __future__ import annotations

from typing import TypedDict

from conveyor.bench.jsonvalue import JSON, JSONObject


class Delta(TypedDict, total=False):
    """A chat chunk's delta."""

    content: str | None


class Choice(TypedDict, total=False):
    """One choice: `text` in a completions stream, `delta` in a chat stream."""

    text: str | None
    delta: Delta | None


class StreamChunk(TypedDict, total=False):
    """One SSE `data:` payload of a completions or chat stream."""

    choices: list[Choice]
    """Non-empty in a token chunk, whatever its text (vLLM counts empty ones too)."""
    usage: JSONObject | None
    """The token counts, in the last chunk (we ask for stream_options.include_usage)."""
    error: JSON
    """The `error` object vLLM sends inside an HTTP 200 stream when it rejects the request."""


def chunk_text(choice: Choice) -> str:
    """The text a choice carries ("" when none)."""
    if "delta" in choice:
        return str((choice.get("delta") or {}).get("content") or "")
    return str(choice.get("text") or "")
