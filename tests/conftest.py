"""Fixtures shared across test folders."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def hf_smollm2():  # noqa: ANN201 (transformers is an optional import)
    """The embedded SmolLM2 GGUF in Hugging Face transformers, float32 with eager attention, dequantized and
    un-permuted by transformers' own code (no accelerate needed): the reference that the model parity and the
    engine parity tests compare with. Loaded once per session, as reading the GGUF through transformers
    takes ~15 s on a 2-core CI box and two modules used to pay it each."""
    transformers = pytest.importorskip("transformers")
    import torch
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from conveyor.model.loader import embedded_gguf_path

    path = embedded_gguf_path()
    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # lm_head is tied to the embedding
    return model.eval()
