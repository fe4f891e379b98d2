"""Start-up gives the grammar matchers exactly the EOS ids the engine stops on that the tokenizer knows:
a completed grammar then allows only a token that ends its request (engine/model_setup.py)."""

from __future__ import annotations

import numpy as np
import torch

from conveyor.config import ModelConfig
from conveyor.core.lifecycle import EosTokenIds
from conveyor.engine.model_files import tokenizer_path
from conveyor.engine.model_setup import structured_outputs_for
from conveyor.engine.tokenizer import Tokenizer
from conveyor.sampling_params import GrammarKind, SamplingParams, StructuredOutput
from conveyor.worker.request_state import RequestState


def _allowed_after(text: str, eos: EosTokenIds, vocab_size: int) -> set[int]:
    """The mask of a `choice: ["yes", "no"]` request whose output so far spells `text`."""
    tokenizer = Tokenizer.from_path(tokenizer_path(ModelConfig()))  # the embedded SmolLM2: 49,152 tokens, EOS 2
    outputs = structured_outputs_for(ModelConfig(), tokenizer, vocab_size, eos)
    params = SamplingParams(max_tokens=8, structured_output=StructuredOutput(GrammarKind.CHOICE, '["yes", "no"]'))
    output = tokenizer.encode(text, add_special_tokens=False)
    state = RequestState("r", [1, 2, 3, *output], 3, [0], params, 0)
    mask = outputs.mask([state], torch.device("cpu"))
    assert mask is not None and outputs.take_failures() == {}
    words = mask.bitmask.numpy().view(np.uint32)[0]
    return {w * 32 + b for w in range(len(words)) for b in range(32) if words[w] >> b & 1}


def test_a_model_eos_outside_the_tokenizer_leaves_the_tokenizers_primary() -> None:
    """Llama-3.1-8B's EOS layout (128001 in 128,256 logits) with SmolLM2's tokenizer: the grammar ends on 2,
    the primary EOS, never on llguidance's own guess (token 0, which the engine did not stop on)."""
    assert _allowed_after("yes", EosTokenIds.resolve(2, (128001,)), 128_256) == {2}


def test_every_eos_the_tokenizer_knows_ends_the_grammar() -> None:
    assert _allowed_after("no", EosTokenIds.resolve(2, (0, 2, 60_000)), 128_256) == {0, 2}
