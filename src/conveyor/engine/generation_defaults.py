"""The model's default sampling parameters: vLLM's `--generation-config` / `--override-generation-config`.

vLLM (config/model.py `get_diff_sampling_param`) reads the model's generation_config.json (else the
generation keys of config.json; a GGUF: none) under `--generation-config auto`, the one in a folder under
`--generation-config PATH`, nothing under `vllm`; merges `--override-generation-config` over it; keeps
repetition_penalty, temperature, top_k, top_p, min_p and max_new_tokens (as max_tokens). A request field
left unset then takes the model's value before vLLM's built-in default. Stdlib only: the API server reads
this at start-up and never loads torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass

from conveyor.config import ConfigError, ModelConfig
from conveyor.engine.vllm_flags import json_object
from conveyor.sampling_params import SamplingParams

logger = logging.getLogger("conveyor.serve")

GENERATION_CONFIG_FILE = "generation_config.json"
AUTO, VLLM = "auto", "vllm"
SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
"""The generation-config keys vLLM turns into default sampling parameters (its `available_params`)."""
_INT_KEYS = frozenset({"top_k", "max_new_tokens"})
_HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}
"""transformers 4's GenerationConfig defaults: vLLM (transformers < 5) reads the file through
`GenerationConfig.to_diff_dict()`, which drops a value equal to these, so a file's `top_k: 50` is no
default in vLLM (the others equal vLLM's own defaults anyway). The override is merged after, unfiltered."""
OverrideItems = tuple[tuple[str, int | float | None], ...]
"""--override-generation-config's sampling keys as (key, value) pairs; None removes the file's value."""


@dataclass(frozen=True)
class SamplingDefaults:
    """Default sampling parameters of requests that leave a field unset (None: vLLM's built-in default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    """Chat: the max_tokens of a request that sets none (the model's max_new_tokens)."""
    max_tokens_cap: int | None = None
    """A cap on every request's max_tokens (vLLM's `override_max_tokens`): max_new_tokens of the
    override, or of the file of `--generation-config PATH`."""

    def as_dict(self) -> dict[str, float]:
        """The fields that are set, for the start-up log."""
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}


NO_SAMPLING_DEFAULTS = SamplingDefaults()
"""vLLM's built-in defaults everywhere (`--generation-config vllm`, a GGUF, tests)."""


def parse_generation_config(text: str) -> str:
    """`--generation-config`: auto, vllm, or a folder holding generation_config.json."""
    if text in (AUTO, VLLM):
        return text
    if not (pathlib.Path(text) / GENERATION_CONFIG_FILE).is_file():
        raise argparse.ArgumentTypeError(f"expected auto, vllm or a folder holding {GENERATION_CONFIG_FILE} "
                                         f"(no {GENERATION_CONFIG_FILE} in {text!r})")
    return text


def parse_override_generation_config(text: str) -> OverrideItems:
    """`--override-generation-config '{"temperature": 0.5}'`: a JSON object; its sampling keys are kept
    (numbers or null), the other keys change no sampling default in vLLM either and are dropped."""
    try:
        return override_items(json_object(text))
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def override_items(data: Mapping[str, object]) -> OverrideItems:
    """An override object's sampling keys (numbers or null); its other keys change no default in vLLM either."""
    return tuple((key, _number(key, value)) for key, value in data.items() if key in SAMPLING_KEYS)


def _number(key: str, value: object) -> int | float | None:
    if value is None:
        return None
    wanted = (int,) if key in _INT_KEYS else (int, float)
    if isinstance(value, bool) or not isinstance(value, wanted):
        kind = "an integer" if key in _INT_KEYS else "a number"
        raise ConfigError(f"{key!r} must be {kind} (got {value!r})")
    return value


def sampling_defaults_of(model: ModelConfig) -> SamplingDefaults:
    """The defaults `model`'s flags describe; a generation config that cannot be read is a ConfigError."""
    read = {} if model.generation_config == VLLM else _read_generation_config(model)
    merged: dict[str, int | float | None] = {key: value for key, value in read.items()
                                             if _HF_DEFAULTS.get(key) != value}
    merged.update(model.override_generation_config)
    values = {key: value for key, value in merged.items() if value is not None}
    from_path = model.generation_config not in (AUTO, VLLM)
    override = dict(model.override_generation_config)
    cap = values.get("max_new_tokens") if from_path else override.get("max_new_tokens")
    return SamplingDefaults(
        temperature=values.get("temperature"), top_p=values.get("top_p"), min_p=values.get("min_p"),
        top_k=_as_int(values.get("top_k")), repetition_penalty=values.get("repetition_penalty"),
        max_tokens=_as_int(values.get("max_new_tokens")), max_tokens_cap=_as_int(cap))


def _as_int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _read_generation_config(model: ModelConfig) -> dict[str, int | float | None]:
    """The sampling keys of the generation config vLLM reads: PATH's file; for auto the model folder's
    generation_config.json, else config.json's generation keys (`GenerationConfig.from_model_config`)."""
    if model.generation_config != AUTO:
        return _sampling_keys(pathlib.Path(model.generation_config) / GENERATION_CONFIG_FILE)
    if model.model is None or pathlib.Path(model.model).suffix == ".gguf":
        return {}  # vLLM reads no generation config for a GGUF (its metadata has none)
    folder = pathlib.Path(model.model)
    for name in (GENERATION_CONFIG_FILE, "config.json"):
        if (folder / name).is_file():
            return _sampling_keys(folder / name)
    return {}


def _sampling_keys(path: pathlib.Path) -> dict[str, int | float | None]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"--generation-config: cannot read {str(path)!r}: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--generation-config: {str(path)!r} is not a JSON object")
    try:
        return {key: _number(key, data[key]) for key in SAMPLING_KEYS if key in data}
    except ConfigError as error:
        raise ConfigError(f"--generation-config: {str(path)!r}: {error}") from None


def default_sampling_params(defaults: SamplingDefaults) -> SamplingParams:
    """vLLM's `LLM.get_default_sampling_params()`: SamplingParams with the model's defaults where it has
    any (max_new_tokens as max_tokens), SamplingParams' own elsewhere. The cap is the server's alone."""
    values = {key: value for key, value in defaults.as_dict().items() if key != "max_tokens_cap"}
    if values.get("top_k") in (-1, 0):  # vLLM's "no top-k"
        del values["top_k"]
    return SamplingParams(**values)  # type: ignore[arg-type]


def log_sampling_defaults(defaults: SamplingDefaults) -> None:
    """vLLM's start-up notice, once, when the model's generation config changes any default."""
    if defaults.as_dict():
        logger.info("Default sampling parameters have been overridden by the model's Hugging Face generation "
                    "config recommended from the model creator: %s. If this is not intended, relaunch with "
                    "`--generation-config vllm`.", defaults.as_dict())
