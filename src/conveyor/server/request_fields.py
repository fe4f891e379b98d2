"""The request fields of vLLM 0.32 conveyor does not implement, and the structured-outputs fields.

Every field of vLLM's completions and chat requests is either honoured or refused with a 400 naming
it; an unknown field is refused too (vLLM ignores it with a warning, which is how a typo such as
`max_token` silently does nothing). A field below is accepted at its default (a client that always
sends `use_beam_search: false` works) and refused at any other value, with the reason.

Structured outputs arrive in three spellings, all honoured: `structured_outputs` (vLLM >= 0.11:
`json`, `regex`, `choice`, `grammar`, `json_object`), `response_format` (OpenAI: `json_object`,
`json_schema`) and the legacy `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
A request may use one constraint; two are a 400, as in vLLM.
"""

from __future__ import annotations

import json
from typing import Any

from conveyor.sampling_params import GrammarKind, StructuredOutput
from conveyor.server.errors import bad_request

BEAM = "beam search is not supported"
MM = "multimodal inputs are not supported (text-only engine)"
KV = "disaggregated serving (KV / encoder transfer) is not supported"
NOT_YET = "not supported by conveyor"
DEFAULT_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), BEAM),
    "length_penalty": ((1.0, 1), BEAM),
    "watermarking": ((None, False), NOT_YET),
    "spaces_between_special_tokens": ((True,), "special tokens are detokenized with the tokenizer's own spacing"),
    "truncate_prompt_tokens": ((None,), "prompts are never truncated: a long one is a 400"),
    "truncation_side": ((None,), "prompts are never truncated: a long one is a 400"),
    "allowed_token_ids": ((None,), NOT_YET + "; use logit_bias"),
    "prompt_logprobs": ((None,), "prompt logprobs are not computed"),
    "logprob_token_ids": ((None,), NOT_YET),
    "bad_words": ((None, ()), NOT_YET + "; use logit_bias"),
    "prompt_embeds": ((None,), "prompts are text or token ids"),
    "return_tokens_as_token_ids": ((None, False), NOT_YET),
    "return_token_ids": ((None, False), NOT_YET),
    "routed_experts_prompt_start": ((0,), "mixture-of-experts models are not served"),
    "return_token_offsets": ((None, False), NOT_YET),
    "mm_payload": (("tensors",), MM),
    "return_mm_kwargs": ((None, False), MM),
    "kv_transfer_params": ((None,), KV),
    "ec_transfer_params": ((None,), KV),
    "vllm_xargs": ((None,), "no custom logits processors are loaded"),
    "repetition_detection": ((None,), NOT_YET),
    "thinking_token_budget": ((None,), "no reasoning parser is configured"),
    "stream_interval": ((None, 1), "every step's tokens are streamed as they come"),
    "guided_whitespace_pattern": ((None,), "JSON whitespace follows llguidance's default"),
}
"""Fields both endpoints accept only at their default: name -> (accepted values, reason)."""
CHAT_DEFAULT_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "reasoning_effort": ((None,), "no reasoning parser is configured"),
    "echo": ((False,), "chat echo is not supported"),
    "continue_final_message": ((False,), NOT_YET),
    "documents": ((None,), "retrieval documents are not passed to chat templates"),
    "chat_template": ((None,), "a request may not bring its own chat template (vLLM's "
                               "--trust-request-chat-template is off)"),
    "chat_template_kwargs": ((None,), "chat templates get no extra keyword arguments"),
    "media_io_kwargs": ((None,), MM),
    "mm_processor_kwargs": ((None,), MM),
    "return_prompt_text": ((None, False), NOT_YET),
    "function_call": ((None, "none"), "tool calling is not supported"),
}
"""Chat-only fields accepted only at their default."""


def check_defaults(body: object, table: dict[str, tuple[tuple[Any, ...], str]]) -> None:
    for name, (accepted, reason) in table.items():
        value = getattr(body, name, None)
        if isinstance(value, list) and not value and () in accepted:
            continue
        if not any(value is a or (type(value) is type(a) and value == a) for a in accepted):
            raise bad_request(f"{name}: {reason} (got {json.dumps(value, default=str)[:80]})", name)


def _schema_text(value: object, field: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise bad_request(f"{field}: not a valid JSON schema ({error.msg})", field) from None
    if not isinstance(value, (dict, bool)):
        raise bad_request(f"{field}: a JSON schema must be an object", field)
    return json.dumps(value)


def _from_structured_outputs(spec: dict[str, Any]) -> list[StructuredOutput]:
    field = "structured_outputs"
    found: list[StructuredOutput] = []
    for key in spec:
        if key not in ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                       "disable_additional_properties", "whitespace_pattern", "structural_tag"):
            raise bad_request(f"{field}.{key}: unknown key", f"{field}.{key}")
    if spec.get("structural_tag") is not None:
        raise bad_request(f"{field}.structural_tag: not supported by conveyor", f"{field}.structural_tag")
    for key in ("disable_additional_properties", "whitespace_pattern"):
        if spec.get(key) not in (None, False):
            raise bad_request(f"{field}.{key}: not supported by conveyor", f"{field}.{key}")
    if spec.get("json") is not None:
        found.append(StructuredOutput(GrammarKind.JSON, _schema_text(spec["json"], f"{field}.json"),
                                      f"{field}.json"))
    if spec.get("regex") is not None:
        found.append(StructuredOutput(GrammarKind.REGEX, _text(spec["regex"], f"{field}.regex"), f"{field}.regex"))
    if spec.get("choice") is not None:
        found.append(_choice(spec["choice"], f"{field}.choice"))
    if spec.get("grammar") is not None:
        found.append(StructuredOutput(GrammarKind.GRAMMAR, _text(spec["grammar"], f"{field}.grammar"),
                                      f"{field}.grammar"))
    if spec.get("json_object"):
        found.append(StructuredOutput(GrammarKind.JSON_OBJECT, "", f"{field}.json_object"))
    if not found and not spec.get("disable_any_whitespace"):
        raise bad_request(f"{field}: give one of json, regex, choice, grammar or json_object", field)
    return found


def _text(value: object, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{field}: must be a non-empty string", field)
    return value


def _choice(value: object, field: str) -> StructuredOutput:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise bad_request(f"{field}: must be a non-empty list of non-empty strings", field)
    return StructuredOutput(GrammarKind.CHOICE, json.dumps(value), field)


def _from_response_format(spec: dict[str, Any]) -> list[StructuredOutput]:
    field = "response_format"
    kind = spec.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [StructuredOutput(GrammarKind.JSON_OBJECT, "", field)]
    if kind == "json_schema":
        inner = spec.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise bad_request(f"{field}.json_schema: must be an object with a `schema`", f"{field}.json_schema")
        schema_field = f"{field}.json_schema.schema"
        return [StructuredOutput(GrammarKind.JSON, _schema_text(inner["schema"], schema_field), schema_field)]
    raise bad_request(f"{field}.type: must be text, json_object or json_schema (got {kind!r})", f"{field}.type")


def structured_output_of(body: Any) -> StructuredOutput | None:
    """The one constraint a request asks for, from whichever spelling it used (None: unconstrained)."""
    found: list[StructuredOutput] = []
    if body.structured_outputs is not None:
        found += _from_structured_outputs(body.structured_outputs)
    if body.response_format is not None:
        found += _from_response_format(body.response_format)
    legacy = {"guided_json": GrammarKind.JSON, "guided_regex": GrammarKind.REGEX,
              "guided_grammar": GrammarKind.GRAMMAR}
    for name, kind in legacy.items():
        value = getattr(body, name)
        if value is not None:
            spec = _schema_text(value, name) if kind is GrammarKind.JSON else _text(value, name)
            found.append(StructuredOutput(kind, spec, name))
    if body.guided_choice is not None:
        found.append(_choice(body.guided_choice, "guided_choice"))
    if len(found) > 1:
        names = ", ".join(sorted({c.field for c in found}))
        raise bad_request(f"{found[1].field}: only one structured-outputs constraint per request (got {names})",
                          found[1].field)
    return found[0] if found else None
