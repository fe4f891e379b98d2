"""tests/bench mirrors src/conveyor/bench: one folder per stage. Helpers every stage's tests share stay
here (bench_fake_server.py, fixtures/), so this folder goes on sys.path for the stage folders' imports."""

import pathlib
import sys

_HERE = str(pathlib.Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
