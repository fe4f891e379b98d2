"""Write SmolLM2's tokenizer, rebuilt from the embedded GGUF, as a Hugging Face directory (default /tmp/tok).

The random-weight GPU runs (both engines, `--tokenizer /tmp/tok`) need a tokenizer directory and no hub is
reachable: tokenizer.json is conveyor's own rebuild of the GGUF's byte-level BPE, tokenizer_config.json
names its special tokens and chat template, so vLLM's AutoTokenizer and conveyor read the same ids.
Usage: python benchmarks/gpu/write_tokenizer.py [OUT_DIR]   (then benchmarks/gpu/stage_study.sh packs it)
"""
import json
import pathlib
import sys

from conveyor.engine.tokenizer import Tokenizer
from conveyor.model.loader import embedded_gguf_path


def write_tokenizer(out: pathlib.Path) -> Tokenizer:
    """The embedded GGUF's tokenizer as out/tokenizer.json + tokenizer_config.json; returns it read back."""
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_gguf(embedded_gguf_path())
    tok.backend.save(str(out / "tokenizer.json"))

    def content(token_id: int | None) -> str | None:
        return None if token_id is None else tok.backend.id_to_token(token_id)

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": content(tok.bos_token_id),
        "eos_token": content(tok.eos_token_id),
        "pad_token": content(tok.pad_token_id),
        "add_bos_token": tok.add_bos_token,
        "chat_template": tok.chat_template,
        "model_max_length": 8192,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return Tokenizer.from_directory(out)


if __name__ == "__main__":
    target = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tok")
    back = write_tokenizer(target)
    print(f"wrote {target}: vocab {back.vocab_size}, eos {back.eos_token_id}")
