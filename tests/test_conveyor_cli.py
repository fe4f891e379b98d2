"""The top-level dispatcher: lazy subcommands, help, and no clash with subcommand flags."""

from __future__ import annotations

import argparse

import pytest

from conveyor import cli


def test_no_subcommand_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_every_listed_subcommand_module_exists() -> None:
    assert set(cli._available()) == set(cli.SUBCOMMANDS)


def test_a_subcommand_flag_named_command_does_not_shadow_the_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, str] = {}

    class Fake:
        @staticmethod
        def add_arguments(parser: argparse.ArgumentParser) -> None:
            parser.add_argument("--command", default="x")

        @staticmethod
        def run(args: argparse.Namespace) -> int:
            seen["command"] = args.command
            return 0

    monkeypatch.setitem(cli.SUBCOMMANDS, "fake", ("conveyor.fake_module", "fake"))
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: object())
    real_import = cli.importlib.import_module
    monkeypatch.setattr(cli.importlib, "import_module",
                        lambda name: Fake if name == "conveyor.fake_module" else real_import(name))
    assert cli.main(["fake", "--command", "serve"]) == 0
    assert seen == {"command": "serve"}


@pytest.mark.parametrize(("argv", "flag"), [(["serve", "-q", "fp8"], "--quantization"),
                                             (["bench", "run", "--rate", "x"], "--rate"),
                                             (["plan", "--concurrency", "many"], "--concurrency")])
def test_a_bad_flag_is_one_line_naming_it(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse prints the whole usage before its error (60 lines for serve); conveyor prints the error."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and flag in err and "usage:" not in err
