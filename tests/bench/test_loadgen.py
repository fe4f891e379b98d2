"""The dispatcher is open loop: sends follow the schedule, never the completions of earlier requests."""

from __future__ import annotations

import asyncio
import time

from bench_fake_server import FakeConfig, FakeServer

from conveyor.bench.client import ClientConfig, RequestStatus
from conveyor.bench.loadgen import new_session, run_open_loop, sleep_until
from conveyor.bench.traces import TraceRequest


def test_sends_follow_the_schedule_while_earlier_requests_stream() -> None:
    requests = [TraceRequest(request_id=f"r{i}", request_class="chat", prompt="ok go", prompt_len=2, output_len=20)
                for i in range(8)]
    offsets = [0.02 * i for i in range(8)]  # 20 ms apart; each request streams for ~20 x 30 ms = 600 ms

    async def go() -> list:
        async with new_session() as session:
            cfg = ClientConfig(base_url=server.base_url, model="fake-model")
            return (await run_open_loop(session, cfg, requests, offsets, show_progress=False)).records

    with FakeServer(FakeConfig(token_delay_s=0.03)) as server:
        records = asyncio.run(go())
    assert [r.status for r in records] == [RequestStatus.COMPLETED] * 8
    assert [r.scheduled_s for r in records] == offsets
    assert all(r.send_lag_s >= 0 for r in records)
    first_end = min(r.end_s for r in records if r.end_s is not None)
    assert all(r.sent_s < first_end for r in records)  # every send happened before any request finished


def test_sleep_until_does_not_wake_early() -> None:
    async def go() -> float:
        deadline = time.perf_counter() + 0.01
        await sleep_until(deadline)
        return time.perf_counter() - deadline

    assert asyncio.run(go()) >= 0
