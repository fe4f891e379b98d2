"""docs/serving.md's `vllm serve` flag table is the one the code uses."""

from __future__ import annotations

import pathlib

from conveyor.server.flag_docs import rewrite

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def test_the_flag_table_in_the_docs_is_generated_from_the_code() -> None:
    text = DOC.read_text()
    assert rewrite(text) == text, "run: python -m conveyor.server.flag_docs docs/serving.md"
