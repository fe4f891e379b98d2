"""Progress of a sweep, study or demo: a bar with ETA on a terminal, one line per event otherwise.

The model: the work is a number of runs (known for fixed rates, estimated for a search). On a terminal
a tqdm bar counts finished runs and shows the elapsed time and the ETA, and event lines (a point's
verdict, a server starting) are printed above it; when stderr is not a terminal (CI logs, files) every
event, and every finished run, is one plain line with a timestamp: no carriage-return redraws pile up.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from tqdm import tqdm


class ProgressReporter:
    """Callable as a progress sink (one message per event); `run_done` advances the bar."""

    def __init__(self, total_runs: int | None, stream: IO[str] | None = None, unit: str = "run") -> None:
        self.stream = stream or sys.stderr
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total, self.done, self.started = total_runs, 0, time.monotonic()
        self.bar: Any = None
        if self.interactive:
            self.bar = tqdm(total=total_runs, unit=unit, file=self.stream, dynamic_ncols=True,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} runs [{elapsed}<{remaining}]")

    def __call__(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message, file=self.stream)
        else:
            print(f"[{time.monotonic() - self.started:6.0f} s] {message}", file=self.stream, flush=True)

    def run_done(self, label: str) -> None:
        self.done += 1
        if self.bar is not None:
            if self.total is not None and self.done > self.total:
                self.bar.total = self.done  # a search ran more points than estimated
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
            return
        of = f"/{self.total}" if self.total is not None else ""
        self(f"run {self.done}{of} done: {label}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
