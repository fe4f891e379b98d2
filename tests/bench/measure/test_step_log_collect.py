"""The step-log collector drains the server during a run too, so a ring smaller than the run loses nothing."""

from __future__ import annotations

import asyncio
import gzip
import pathlib

import aiohttp
from bench_fake_server import FakeConfig, FakeServer

from conveyor.bench.measure.step_log import (
    StepLogCollector,
    read_step_log,
    write_step_log,
)


def test_polling_collects_every_step_in_order_and_none_from_before() -> None:
    async def main(server: FakeServer) -> list | None:
        async with aiohttp.ClientSession() as session:
            collector = StepLogCollector(session, server.base_url, api_key=None, interval_s=0.01)
            await collector.start()
            for step in range(30):  # the "engine" logs a step every few ms; the collector drains as it goes
                server.state.steps.append({"step": step})
                await asyncio.sleep(0.003)
            return await collector.stop()

    with FakeServer(FakeConfig(step_log=True)) as server:
        server.state.steps.append({"step": -1})  # before the run
        rows = asyncio.run(main(server))
        assert server.state.num_step_log_drains > 3  # drained during the run, not only at its ends
    assert rows == [{"step": step} for step in range(30)]


def test_a_server_without_a_step_log_is_not_polled() -> None:
    async def main(server: FakeServer) -> list | None:
        async with aiohttp.ClientSession() as session:
            collector = StepLogCollector(session, server.base_url, api_key=None, interval_s=0.01)
            await collector.start()
            await asyncio.sleep(0.05)
            return await collector.stop()

    with FakeServer() as server:
        assert asyncio.run(main(server)) is None


def test_an_archived_gzipped_step_log_reads_like_the_plain_one(tmp_path: pathlib.Path) -> None:
    rows = [{"step": 0, "wall_s": 0.01}, {"step": 1, "wall_s": 0.02}]
    write_step_log(tmp_path, rows)
    plain = read_step_log(tmp_path)
    with (tmp_path / "step_log.jsonl").open("rb") as src, gzip.open(tmp_path / "step_log.jsonl.gz", "wb") as dst:
        dst.write(src.read())
    (tmp_path / "step_log.jsonl").unlink()
    assert read_step_log(tmp_path) == plain == rows
    (tmp_path / "step_log.jsonl.gz").unlink()
    assert read_step_log(tmp_path) == []
