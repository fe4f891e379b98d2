"""`--api-server-count 2`: two API-server processes on one port and one engine core; the in-flight cap is
global, /metrics sums the front ends' counters and shows the engine's gauges once; SIGTERM drains both
and everything exits 0 (slow: starts real processes)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import httpx2 as httpx
import pytest
from serve_process import Server, running_server, scrape, stream_status, wait_idle

pytestmark = pytest.mark.slow

CAP = 16
SERVE_ARGS = ["--api-server-count", "2", "--max-model-len", "512", "--max-num-seqs", "128",
              "--max-num-queued-reqs", str(CAP), "--shutdown-grace", "10"]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server(SERVE_ARGS) as server:
        yield server


def test_one_engine_and_two_api_servers(server: Server) -> None:
    children = server.children()
    assert len(children) == 3, children  # the engine core and two API servers
    assert all(b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read() for pid in children)


def codes(statuses: list[tuple[int, dict]]) -> list[int]:
    return [code for code, _ in statuses]


def test_a_burst_on_an_idle_server_admits_exactly_the_global_cap(server: Server) -> None:
    """128 free running slots, --max-num-queued-reqs 16, two front ends: exactly 16 of 100 are admitted."""
    before = wait_idle(server)
    statuses: list[tuple[int, dict]] = []
    reason = "vllm:admission_rejections_total{reason=max_num_queued_reqs}"

    async def main() -> dict[str, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=100)) as c:
            tasks = [asyncio.ensure_future(stream_status(c, i, statuses)) for i in range(100)]
            deadline = time.monotonic() + 60
            while True:
                metrics = await asyncio.to_thread(scrape, server)
                if codes(statuses).count(503) == 100 - CAP and metrics.get("vllm:num_requests_running") == CAP:
                    break
                assert time.monotonic() < deadline, (codes(statuses).count(503), metrics.get("vllm:num_requests_running"))
                await asyncio.sleep(0.1)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return metrics

    during = asyncio.run(main())
    assert codes(statuses).count(503) == 100 - CAP
    assert during["vllm:num_requests_waiting"] == 0  # all 16 run: the cap, not the slots, bound them
    assert during[reason] - before.get(reason, 0) == 100 - CAP  # summed over both front ends
    abort = "vllm:request_success_total{finished_reason=abort}"
    # The engine's gauges go idle before each front end has counted its aborted streams (the counters
    # reach /metrics from two processes): wait for them to settle, then require exactly CAP.
    deadline = time.monotonic() + 30
    while (after := wait_idle(server)).get(abort, 0) - before.get(abort, 0) < CAP and time.monotonic() < deadline:
        time.sleep(0.2)
    assert after.get(abort, 0) - before.get(abort, 0) == CAP


def test_counters_are_summed_once_across_front_ends(server: Server) -> None:
    before = wait_idle(server)

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            replies = await asyncio.gather(*(client.post("/v1/completions", json={
                "prompt": f"Hello {i}", "max_tokens": 3 + i % 3, "ignore_eos": True}) for i in range(12)))
        return [r.json()["usage"]["completion_tokens"] for r in replies]

    tokens = asyncio.run(main())
    after = [wait_idle(server) for _ in range(4)]  # whichever front end answers the scrape
    for metrics in after:
        assert metrics["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == sum(tokens)
        length = "vllm:request_success_total{finished_reason=length}"
        assert metrics[length] - before.get(length, 0) == 12
        assert [v for k, v in metrics.items() if k.startswith("conveyor:config_info")] == [1.0]  # not one per front end


def test_sigterm_drains_both_front_ends_and_exits_0(server: Server) -> None:
    wait_idle(server)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, "".join(server.log[-30:])
    log = "".join(server.log)
    assert log.count("no longer admitting") == 2 and "engine core stopped" in log
