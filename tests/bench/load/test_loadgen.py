"""Load modes against the fake server: open loop follows the schedule, a concurrency cap is never exceeded
(counted by the server), closed loop sends as slots free up, the slot gate is first come first served."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from bench_fake_server import FakeConfig, FakeServer

from conveyor.bench.load.client import ClientConfig, RequestRecord, RequestStatus
from conveyor.bench.load.loadgen import LoadPlan, Progress, SlotGate, eta_s, fmt_eta, new_session, run_load, sleep_until
from conveyor.bench.trace.traces import TraceRequest


def _reqs(n: int, output_len: int = 8) -> list[TraceRequest]:
    return [TraceRequest(request_id=f"r{i}", request_class="chat", prompt="ok go", prompt_len=2, output_len=output_len)
            for i in range(n)]


def _run(server: FakeServer, plan: LoadPlan) -> list[RequestRecord]:
    async def go() -> list[RequestRecord]:
        async with new_session() as session:
            cfg = ClientConfig(base_url=server.base_url, model="fake-model")
            return (await run_load(session, cfg, plan)).records

    return asyncio.run(go())


def _plan(requests: list[TraceRequest], offsets: list[float], cap: int | None = None) -> LoadPlan:
    return LoadPlan(units=[[r] for r in requests], offsets_s=offsets, max_concurrency=cap)


def test_sends_follow_the_schedule_while_earlier_requests_stream() -> None:
    requests = _reqs(8, output_len=20)
    offsets = [0.02 * i for i in range(8)]  # 20 ms apart; each request streams for ~20 x 30 ms = 600 ms
    with FakeServer(FakeConfig(token_delay_s=0.03)) as server:
        records = _run(server, _plan(requests, offsets))
    assert [r.status for r in records] == [RequestStatus.COMPLETED] * 8
    assert [r.scheduled_s for r in records] == offsets
    assert all(r.send_lag_s >= 0 and r.client_queue_s == 0 for r in records)
    first_end = min(r.end_s for r in records if r.end_s is not None)
    assert all(r.sent_s < first_end for r in records)  # every send happened before any request finished


@pytest.mark.parametrize("cap", [1, 3])
def test_closed_loop_never_exceeds_the_cap_and_refills_each_freed_slot(cap: int) -> None:
    n = 4 * cap + 2
    with FakeServer(FakeConfig(token_delay_s=0.004)) as server:
        records = _run(server, _plan(_reqs(n), [0.0] * n, cap=cap))
        assert server.state.max_in_flight == cap  # counted by the server: reached, never exceeded
    assert [r.status for r in records] == [RequestStatus.COMPLETED] * n
    by_send = sorted(records, key=lambda r: r.sent_s)
    ends = sorted(float(r.end_s or 0.0) for r in records)
    for k, rec in enumerate(by_send[cap:]):  # the (cap + k)-th send waits for the k-th end
        assert rec.sent_s >= ends[k] and rec.client_queue_s > 0
    assert all(r.send_lag_s < 0.5 for r in records)  # lag counts from the freed slot, not from t=0
    if cap == 1:  # synchronous: strictly one after the other
        assert all(b.sent_s >= a.end_s for a, b in zip(by_send, by_send[1:]))  # type: ignore[operator]


def test_rate_with_a_cap_queues_in_the_client_and_keeps_the_order() -> None:
    n = 10
    offsets = [0.005 * i for i in range(n)]  # 200 req/s offered, each request ~40 ms: the cap binds
    with FakeServer(FakeConfig(token_delay_s=0.005)) as server:
        records = _run(server, _plan(_reqs(n), offsets, cap=2))
        assert server.state.max_in_flight <= 2
    assert [r.request_id for r in sorted(records, key=lambda r: r.sent_s)] == [f"r{i}" for i in range(n)]
    assert records[0].client_queue_s == 0 and records[-1].client_queue_s > 0.05
    for r in records:
        assert r.sent_s == pytest.approx(r.scheduled_s + r.client_queue_s + r.send_lag_s)


def test_slot_gate_is_first_come_first_served_and_hands_slots_over() -> None:
    async def go() -> tuple[list[str], int, float]:
        gate = SlotGate(1)
        order: list[str] = []
        assert await gate.acquire() == -math.inf

        async def waiter(name: str) -> None:
            await gate.acquire()
            order.append(name)
            gate.release()

        tasks = [asyncio.create_task(waiter(n)) for n in "abc"]
        doomed = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)
        doomed.cancel()  # a cancelled waiter must not take or leak a slot
        t_release = time.perf_counter()
        gate.release()
        await asyncio.gather(*tasks)
        return order, gate.in_flight, t_release

    order, in_flight, _ = asyncio.run(go())
    assert order == ["a", "b", "c"] and in_flight == 0


def test_slot_gate_reports_when_the_slot_fell_free() -> None:
    async def go() -> tuple[float, float]:
        gate = SlotGate(1)
        await gate.acquire()
        later = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0.01)
        before = time.perf_counter()
        gate.release()
        return before, await later

    before, freed_at = asyncio.run(go())
    assert before <= freed_at <= before + 0.01


def test_plan_rejects_mismatched_offsets_and_bad_caps() -> None:
    with pytest.raises(ValueError, match="one send offset"):
        _plan(_reqs(2), [0.0])
    with pytest.raises(ValueError, match="--max-concurrency"):
        _plan(_reqs(1), [0.0], cap=0)


def test_sleep_until_does_not_wake_early() -> None:
    async def go() -> float:
        deadline = time.perf_counter() + 0.01
        await sleep_until(deadline)
        return time.perf_counter() - deadline

    assert asyncio.run(go()) >= 0


def test_the_eta_is_the_later_of_the_schedule_and_the_completion_rate(capsys: pytest.CaptureFixture[str]) -> None:
    assert eta_s(200, 0, 5.0, 100.0) == (95.0, False)  # nothing ended yet: the schedule, a lower bound
    assert eta_s(200, 0, 5.0, 0.0) == (None, False)  # all due at once, nothing ended: unknown
    assert eta_s(200, 1, 60.0, 100.0, first_done_s=59.0) == (40.0, False)  # one end predicts nothing
    assert eta_s(200, 21, 30.0, 100.0, first_done_s=10.0) == (pytest.approx(179 * 20 / 20), True)  # server slower
    assert eta_s(200, 150, 90.0, 100.0, first_done_s=1.0) == (pytest.approx(max(10.0, 50 * 89 / 149)), True)
    assert fmt_eta(125.4) == "ETA 2:05" and fmt_eta(30, estimate=False) == "ETA >0:30" and fmt_eta(None) == "ETA ?"
    Progress(10, enabled=True, last_due_s=30.0).draw_counts(2, (1, 0, 0), final=False)
    assert "ETA >0:" in capsys.readouterr().err
