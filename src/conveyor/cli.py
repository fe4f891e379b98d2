"""`conveyor` command line: a thin dispatcher.

Each subcommand lives beside the package it drives, in a module exposing
`add_arguments(parser: argparse.ArgumentParser) -> None` and `run(args: argparse.Namespace) -> int`.
Only the chosen subcommand's module is imported, so `conveyor bench ...` never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from typing import NoReturn

# name -> (module, one-line help). A module that does not exist yet is simply not offered.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("conveyor.demo", "Run the continuous-vs-static study on the embedded model and write the report"),
    "serve": ("conveyor.server.cli", "Start the OpenAI-compatible server (vLLM flags)"),
    "generate": ("conveyor.engine.cli", "Generate offline from prompts on the command line"),
    "simulate": ("conveyor.sim.cli", "Step-level simulation: continuous vs static, or a trace replayed (what-if)"),
    "trace": ("conveyor.bench.cli.trace", "Make, import, anonymize and show request traces"),
    "bench": ("conveyor.bench.cli.bench", "Drive a server with a trace: run, sweep, study"),
    "report": ("conveyor.bench.cli.report", "Dashboard tables, plots and recommendation from run directories"),
    "plan": ("conveyor.bench.cli.plan", "GPU memory plan: weights + KV cache + overhead against a GPU catalog"),
}


class OneLineErrors(argparse.ArgumentParser):
    """A parser whose errors are one line naming the flag; argparse's default prints the whole usage first,
    60 lines for `conveyor serve`, which buries the one that matters. Subparsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _available() -> dict[str, tuple[str, str]]:
    return {name: spec for name, spec in SUBCOMMANDS.items() if importlib.util.find_spec(spec[0]) is not None}


def build_parser(selected: str | None) -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="conveyor", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="conveyor_subcommand", metavar="COMMAND")
    for name, (module_name, help_text) in _available().items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            importlib.import_module(module_name).add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(selected)
    if selected in _available():
        # A subcommand may accept another tool's spellings (`conveyor serve` reads `vllm serve` lines).
        preprocess = getattr(importlib.import_module(_available()[selected][0]), "preprocess_argv", None)
        if preprocess is not None:
            index = args_list.index(selected)
            try:
                args_list = args_list[: index + 1] + preprocess(args_list[index + 1:])
            except ValueError as error:  # config.ConfigError: a bad --config file or dotted key
                parser.exit(2, f"conveyor {selected}: error: {error}\n")
    args = parser.parse_args(args_list)
    if args.conveyor_subcommand is None:
        parser.print_help()
        return 2
    module = importlib.import_module(_available()[args.conveyor_subcommand][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
