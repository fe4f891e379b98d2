"""Collecting the engine's step log with a run (`conveyor bench run --collect-step-log`).

The server keeps its newest `--step-log-size` step records and `GET /step_log` drains them (docs/serving.md,
"The step log"). The collector drains once before the run, so the file holds this run's steps only,
then every `interval_s` while it runs, so a ring smaller than the run loses nothing, and once after.
A server without the route (vLLM, or conveyor with --step-log-size 0) answers 404: the run goes on and
writes no step_log.jsonl. The records stay JSON objects here: bench never imports the engine, and
step_model.py reads them by field name.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import pathlib
from typing import Any

import aiohttp

from conveyor.bench.jsonvalue import JSON

STEP_LOG_FILE = "step_log.jsonl"
"""In the run directory: one step record a line, oldest first (core/step_log.py's StepRecord fields)."""
POLL_INTERVAL_S = 2.0
"""How often a run drains the server's ring (a ring of 10 000 steps then holds 20 s at 500 steps/s)."""


async def drain_step_log(session: aiohttp.ClientSession, base_url: str,
                         headers: dict[str, str]) -> list[dict[str, JSON]] | None:
    """GET /step_log's records, or None when the server offers none (404, an error, no answer)."""
    url = base_url.rstrip("/") + "/step_log"
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as response:
            if response.status != 200:
                return None
            text = await response.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [row for row in rows if isinstance(row, dict)]


class StepLogCollector:
    """Drains GET /step_log around and during a run; `offered` is False when the server has no step log."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, api_key: str | None,
                 interval_s: float = POLL_INTERVAL_S) -> None:
        self._session, self._base_url, self._interval_s = session, base_url, interval_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.rows: list[dict[str, JSON]] = []
        self.offered = False
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        """Forget the steps logged before the run; poll while it runs (only if the server offers a log)."""
        self.offered = await drain_step_log(self._session, self._base_url, self._headers) is not None
        if self.offered:
            self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        """Drain every interval, and once more when stopped. Never cancelled mid-request: records the server
        handed over in an answer that was never read would be lost."""
        while not self._stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._interval_s)
            self.rows.extend(await drain_step_log(self._session, self._base_url, self._headers) or [])

    async def stop(self) -> list[dict[str, JSON]] | None:
        """Every step of the run, oldest first (None: the server offers no step log)."""
        self._stopping.set()
        if self._task is not None:
            await self._task
        return self.rows if self.offered else None


def write_step_log(run_dir: pathlib.Path, rows: list[dict[str, Any]] | None) -> None:
    """step_log.jsonl in the run directory (nothing when the server offered no step log)."""
    if rows is None:
        return
    (run_dir / STEP_LOG_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def read_step_log(run_dir: pathlib.Path) -> list[dict[str, JSON]]:
    """The step records of a run directory (empty when it has no step_log.jsonl); an archived
    step_log.jsonl.gz stands in for a missing step_log.jsonl (results kept under benchmarks/results/)."""
    path, packed = run_dir / STEP_LOG_FILE, run_dir / (STEP_LOG_FILE + ".gz")
    if path.is_file():
        return read_step_log_file(path)
    return read_step_log_file(packed) if packed.is_file() else []


def read_step_log_file(path: pathlib.Path) -> list[dict[str, JSON]]:
    """The step records of one JSONL file (gzip-compressed when its name ends in .gz), oldest first: a run
    directory's step_log.jsonl, or a log drained from GET /step_log beside another client's run."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            text = f.read()
    else:
        text = path.read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [row for row in rows if isinstance(row, dict)]
