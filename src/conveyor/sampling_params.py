"""Per-request sampling and stopping parameters, with vLLM's names and meanings.

Validation happens at construction and raises `ValueError` whose message names the field, so the
server can turn it into an HTTP 400 unchanged.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

INT64_MAX = 2**63 - 1
"""Integers travel to the engine core as msgpack int64: larger ones are refused here, naming the field."""
MAX_TEMPERATURE = 2.0
"""vLLM's upper bound on temperature."""
MAX_LOGIT_BIAS = 100.0
"""logit_bias values are clamped to [-100, 100], as vLLM and OpenAI do."""


class GrammarKind(enum.Enum):
    """What a structured-outputs constraint is written in (vLLM's StructuredOutputsParams fields)."""

    JSON = "json"
    """A JSON schema (the text of it)."""
    JSON_OBJECT = "json_object"
    """Any JSON object."""
    REGEX = "regex"
    """A regular expression the whole output must match."""
    CHOICE = "choice"
    """One of a list of strings."""
    GRAMMAR = "grammar"
    """A Lark (or llguidance) grammar; GBNF is converted."""
    LLGUIDANCE = "llguidance"
    """llguidance's serialized grammar, built from one of the kinds above: what the API server sends the
    engine core once it checked a constraint, so the core does not build it again (never from HTTP)."""


@dataclass(frozen=True)
class StructuredOutput:
    """One structured-outputs constraint on a request's output."""

    kind: GrammarKind
    """What `spec` is."""
    spec: str
    """The schema (JSON text), the regex, the grammar, or the choices as a JSON list; "" for JSON_OBJECT."""
    field: str = "structured_outputs"
    """The request field it came from (`response_format`, `guided_json`, ...), for error messages."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop."""

    temperature: float = 1.0
    """0 means greedy; otherwise logits are divided by it before sampling."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability mass reaches top_p."""
    top_k: int | None = None
    """Keep only the k most likely tokens (None: all)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    seed: int | None = None
    """Per-request seed: the same seed and inputs give the same tokens."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated (OpenAI semantics)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens in the prompt or output (>1 discourages)."""
    max_tokens: int | None = 16
    """Most tokens to generate (None: up to max_model_len)."""
    min_tokens: int = 0
    """EOS and stop token ids are ignored until this many tokens have been generated."""
    stop: tuple[str, ...] = ()
    """Strings that end generation; the stop string is not included in the output."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (the token is kept in the output ids, as vLLM does)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    logprobs: int | None = None
    """Return the log-probability of the sampled token plus this many top alternatives."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string in the returned text."""
    skip_special_tokens: bool = True
    """Drop special tokens when detokenizing."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before sampling (values clamped to [-100, 100])."""
    structured_output: StructuredOutput | None = None
    """A grammar the output must follow (applied as a token mask in the sampler), if any."""
    extra: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    """Free-form annotations carried to the output (never read by the engine)."""

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            _check(math.isfinite(value), name, f"must be a finite number (got {value})")
        _check(0.0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
               f"must be in [0, {MAX_TEMPERATURE:g}] (got {self.temperature})")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1] (got {self.top_p})")
        _check(self.top_k is None or self.top_k >= 1, "top_k", f"must be >= 1 or unset (got {self.top_k})")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1] (got {self.min_p})")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", f"must be > 0 (got {self.repetition_penalty})")
        _check(self.seed is None or -INT64_MAX - 1 <= self.seed <= INT64_MAX, "seed", "must fit in 64 bits")
        _check(self.max_tokens is None or self.max_tokens <= INT64_MAX, "max_tokens", "must fit in 64 bits")
        _check(self.top_k is None or self.top_k <= INT64_MAX, "top_k", "must fit in 64 bits")
        _check(all(math.isfinite(bias) for _, bias in self.logit_bias), "logit_bias", "values must be finite")
        _check(all(0 <= token_id <= INT64_MAX for token_id, _ in self.logit_bias), "logit_bias",
               "keys must be token ids >= 0")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"must be >= 1 (got {self.max_tokens})")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0 (got {self.min_tokens})")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(isinstance(t, int) and 0 <= t <= INT64_MAX for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers")
        _check(self.min_tokens <= INT64_MAX, "min_tokens", "must fit in 64 bits")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field_name} {message}")
