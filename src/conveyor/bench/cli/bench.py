"""`conveyor bench run | sweep | study | calibrate`: a dispatcher; each action lives in its own module.

As in conveyor/cli.py, an action whose module does not exist yet is simply not offered.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

ACTIONS: dict[str, tuple[str, str]] = {
    "run": ("conveyor.bench.cli.run", "One open-loop run of a trace against a server -> a run directory"),
    "sweep": ("conveyor.bench.cli.sweep", "Runs at increasing rates until the SLO breaks"),
    "study": ("conveyor.bench.cli.study", "Sweeps over several server configurations"),
    "calibrate": ("conveyor.bench.cli.calibrate", "Fit a step-time model to runs' step logs -> a calibration file"),
}


def _available() -> dict[str, tuple[str, str]]:
    return {name: spec for name, spec in ACTIONS.items() if importlib.util.find_spec(spec[0]) is not None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every available action gets its flags (all are light: no torch). An action whose module fails to
    import is still listed, and says why when chosen, so one broken action never breaks the others."""
    sub = parser.add_subparsers(dest="bench_command", metavar="ACTION", required=True)
    for name, (module_name, help_text) in _available().items():
        action = sub.add_parser(name, help=help_text, description=help_text)
        try:
            importlib.import_module(module_name).add_arguments(action)
        except Exception as exc:  # noqa: BLE001 - reported when this action is run
            action.set_defaults(bench_import_error=f"{module_name}: {exc!r}")


def run(args: argparse.Namespace) -> int:
    error = getattr(args, "bench_import_error", None)
    if error is not None:
        print(f"conveyor bench {args.bench_command}: cannot load the action: {error}", file=sys.stderr)
        return 2
    module = importlib.import_module(_available()[args.bench_command][0])
    return int(module.run(args) or 0)
