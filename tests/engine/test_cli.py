"""`conveyor generate` flag handling (no model is loaded: bad flags exit before that)."""

from __future__ import annotations

import pytest

from conveyor.cli import main


@pytest.mark.parametrize(("argv", "flag"), [
    (["generate", "--temperature", "-1"], "--temperature"),
    (["generate", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["generate", "--block-size", "3"], "--block-size"),
])
def test_bad_flags_exit_2_naming_the_flag(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert flag in capsys.readouterr().err
