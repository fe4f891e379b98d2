"""Incremental detokenization: whole characters only, stop strings across token boundaries."""

from __future__ import annotations

from engine_fakes import ByteTokenizer

from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.sampling_params import SamplingParams

PROMPT = [ord("Q") + 1, ord(":") + 1]


def stream(tokenizer: ByteTokenizer, token_ids: list[int], params: SamplingParams) -> list[str]:
    """Feed one token per step (finished on the last); return the text of every step."""
    detok = IncrementalDetokenizer(tokenizer, PROMPT, params)
    texts = []
    for i, token_id in enumerate(token_ids):
        update = detok.update([token_id], finished=i == len(token_ids) - 1)
        texts.append(update.new_text)
        if update.stop_string is not None:
            break
    return texts


def test_multibyte_character_split_across_tokens_is_held_until_complete() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("a€b")  # € is 3 bytes: e2 82 ac
    texts = stream(tok, ids, SamplingParams())
    assert texts == ["a", "", "", "€", "b"]
    assert all("\ufffd" not in t for t in texts)


def test_emoji_split_by_merges_and_bytes() -> None:
    tok = ByteTokenizer(merges=["😀".encode()[:2], "😀".encode()[2:], "é".encode()])
    ids = tok.ids_for(["😀".encode()[:2], "😀".encode()[2:], "é".encode(), b"!"])
    assert stream(tok, ids, SamplingParams()) == ["", "😀", "é", "!"]


def test_concatenation_equals_full_decode() -> None:
    tok = ByteTokenizer()
    text = "Grüße 👋🏽 日本語 done"
    ids = tok.encode(text)
    assert "".join(stream(tok, ids, SamplingParams())) == text


def test_incomplete_character_at_finish_is_flushed_as_decoded() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("x") + tok.encode("€")[:2]
    texts = stream(tok, ids, SamplingParams())
    assert "".join(texts) == "x\ufffd"


def test_special_tokens_skipped_or_kept() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("hi") + [tok.eos_token_id]
    assert "".join(stream(tok, ids, SamplingParams())) == "hi"
    assert "".join(stream(tok, ids, SamplingParams(skip_special_tokens=False))) == "hi<eos>"


def test_stop_string_spanning_tokens_truncates_and_reports() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("one two\n\nthree")
    detok = IncrementalDetokenizer(tok, PROMPT, SamplingParams(stop=("\n\n",)))
    sent, stop, fed = "", None, 0
    for token_id in ids:
        update = detok.update([token_id], finished=False)
        sent += update.new_text
        fed += 1
        if update.stop_string is not None:
            stop = update.stop_string
            break
    assert stop == "\n\n" and sent == "one two" and fed == len("one two\n\n")


def test_stop_string_prefix_is_held_back_then_released() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, PROMPT, SamplingParams(stop=("END",)))
    texts = [detok.update([t], finished=False).new_text for t in tok.encode("xEN")]
    assert "".join(texts) == "x"  # "EN" could start "END": not sent yet
    final = detok.update(tok.encode("o"), finished=True)
    assert final.stop_string is None and "".join(texts) + final.new_text == "xENo"


def test_include_stop_str_in_output() -> None:
    tok = ByteTokenizer()
    params = SamplingParams(stop=("cd",), include_stop_str_in_output=True)
    assert "".join(stream(tok, tok.encode("abcdef"), params)) == "abcd"


def test_earliest_of_several_stop_strings_wins() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, PROMPT, SamplingParams(stop=("zzz", "b")))
    update = detok.update(tok.encode("abzzz"), finished=False)
    assert update.stop_string == "b" and update.new_text == "a" and update.num_tokens_consumed == 2


def test_stop_string_inside_multibyte_text() -> None:
    tok = ByteTokenizer()
    texts = stream(tok, tok.encode("日本語。次"), SamplingParams(stop=("。",)))
    assert "".join(texts) == "日本語"
