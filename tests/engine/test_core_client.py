"""The split engine over real ipc sockets (engine loop on a thread, fake scheduler and runner): streaming,
admission before any output, aborts that free the core, stop strings, queue timeouts, engine death,
shutdown, and outputs routed to the right one of two front ends."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading

import pytest
from engine_fakes import FakeRunner, FakeScheduler, make_fake_core
from proc_harness import serving

from conveyor.config import EngineConfig, SchedulerConfig
from conveyor.engine.admission import make_shared_counts
from conveyor.engine.messages import ShutdownEngine
from conveyor.engine.types import (
    EngineDeadError,
    EngineOverloadedError,
    GenerateRequest,
    IterationStats,
    OverloadReason,
    RequestRejectedError,
)
from conveyor.request import FinishReason
from conveyor.sampling_params import SamplingParams


def core(config: EngineConfig | None = None, scheduler: FakeScheduler | None = None, delay_s: float = 0.001):
    # 1 ms per step: a 2000-token request stays live long enough to be aborted, cancelled or queued behind
    return make_fake_core(config, scheduler, FakeRunner(delay_s=delay_s))


def req(request_id: str, max_tokens: int = 8, prompt: list[int] | None = None, **params) -> GenerateRequest:
    return GenerateRequest(request_id, prompt or [105, 106], SamplingParams(max_tokens=max_tokens, **params))


async def collect(client, request: GenerateRequest) -> list:  # noqa: ANN001
    return [out async for out in client.generate(request)]


async def until(predicate, timeout_s: float = 5.0) -> None:  # noqa: ANN001
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_concurrent_generates_complete_with_text_and_stats() -> None:
    async def main() -> None:
        async with serving(core()) as served:
            seen: list[IterationStats] = []
            served.client.add_stats_listener(seen.append)
            results = await asyncio.gather(*(collect(served.client, req(f"r{i}", 5 + i)) for i in range(10)))
            for i, outs in enumerate(results):
                assert outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].num_output_tokens == 5 + i
                assert "".join(o.new_text for o in outs) == ("abcdefghij" * 2)[:5 + i]
            assert served.client.num_unfinished_requests() == 0
            await until(lambda: sum(len(s.finished) for s in seen) == 10)
            assert all(s.scheduler is not None for s in seen)
            # on CPU the engine process's peak is its peak RSS: the process at least holds the interpreter
            assert all(s.peak_memory_bytes is not None and s.peak_memory_bytes > 10 * 2**20 for s in seen)
    asyncio.run(main())


def test_aclose_aborts_in_the_core_and_stats_return_to_zero() -> None:
    async def main() -> None:
        scheduler = FakeScheduler()
        async with serving(core(scheduler=scheduler)) as served:
            seen: list[IterationStats] = []
            served.client.add_stats_listener(seen.append)
            stream = served.client.generate(req("a", max_tokens=1000))
            await stream.__anext__()
            await stream.aclose()
            await until(lambda: any(f.finish_reason is FinishReason.ABORT for s in seen for f in s.finished)
                        and seen[-1].scheduler.kv_cache_usage == 0)
            assert not scheduler.has_unfinished_requests()
            assert served.client.num_unfinished_requests() == 0
    asyncio.run(main())


def test_reset_prefix_cache_travels_to_the_core_and_back() -> None:
    async def main() -> None:
        scheduler = FakeScheduler()
        async with serving(core(scheduler=scheduler)) as served:
            assert await served.client.reset_prefix_cache()
            stream = served.client.generate(req("a", max_tokens=1000))
            await stream.__anext__()
            assert not await served.client.reset_prefix_cache()  # "a" runs: refused
            assert await served.client.reset_prefix_cache(reset_running_requests=True)
            await stream.aclose()
            assert scheduler.resets == [False, False, True]
    asyncio.run(main())


class StuckRunner(FakeRunner):
    """A step that does not end until the test lets it: a core whose loop stopped turning."""

    def __init__(self) -> None:
        super().__init__()
        self.go, self.entered = threading.Event(), threading.Event()

    def execute(self, sched):  # noqa: ANN001, ANN201
        self.entered.set()
        self.go.wait(30)
        return super().execute(sched)


def test_check_health_is_false_while_the_core_is_stuck_and_true_again_after() -> None:
    async def main() -> None:
        runner = StuckRunner()
        async with serving(make_fake_core(None, None, runner)) as served:
            assert await served.client.check_health(2.0)
            stream = served.client.generate(req("a", max_tokens=2))
            first = asyncio.ensure_future(stream.__anext__())
            await until(runner.entered.is_set)
            assert not await served.client.check_health(0.3)  # the loop is inside a step that never ends
            runner.go.set()
            await first
            assert await served.client.check_health(2.0)
            await stream.aclose()
        assert not await served.client.check_health(0.3)  # closed
    asyncio.run(main())


def test_closing_before_the_first_read_aborts() -> None:
    async def main() -> None:
        scheduler = FakeScheduler()
        async with serving(core(scheduler=scheduler)) as served:
            stream = served.client.generate(req("a", max_tokens=1000))
            await stream.aclose()
            assert served.client.num_unfinished_requests() == 0
            await until(lambda: not scheduler.has_unfinished_requests())
    asyncio.run(main())


def test_admission_is_decided_before_any_output() -> None:
    config = EngineConfig(scheduler=SchedulerConfig(max_model_len=10, max_num_queued_reqs=2))
    async def main() -> None:
        async with serving(core(config, delay_s=0.05), config) as served:
            client = served.client
            with pytest.raises(RequestRejectedError) as too_long:
                client.generate(req("long", max_tokens=4, prompt=[1] * 8))
            assert too_long.value.field == "max_tokens"
            with pytest.raises(RequestRejectedError, match="out of range"):
                client.generate(req("bad", prompt=[1, 10**6]))
            first = client.generate(req("a", max_tokens=8))
            with pytest.raises(RequestRejectedError) as duplicate:
                client.generate(req("a"))
            assert duplicate.value.field == "request_id"
            second = client.generate(req("b", max_tokens=8))
            with pytest.raises(EngineOverloadedError) as full:
                client.generate(req("c"))
            assert full.value.reason is OverloadReason.MAX_NUM_QUEUED_REQS
            await first.aclose()  # leaving frees its slot at once
            third = client.generate(req("c", max_tokens=2))
            assert [o.num_output_tokens async for o in third][-1] == 2
            await second.aclose()
    asyncio.run(main())


def test_queue_timeout_reaches_the_stream_with_its_message() -> None:
    config = EngineConfig(scheduler=SchedulerConfig(queue_timeout_s=0.05))
    async def main() -> None:
        scheduler = FakeScheduler(max_running=1, queue_timeout_s=0.05)
        async with serving(core(config, scheduler), config) as served:
            blocker = served.client.generate(req("a", max_tokens=1000))
            await blocker.__anext__()
            outs = await collect(served.client, req("b"))
            assert [o.finish_reason for o in outs] == [FinishReason.QUEUE_TIMEOUT]
            assert "--queue-timeout=0.05" in outs[0].error_message
            await blocker.aclose()
    asyncio.run(main())


def test_stop_string_ends_with_stop_and_frees_the_core() -> None:
    async def main() -> None:
        scheduler = FakeScheduler()
        async with serving(core(scheduler=scheduler)) as served:
            seen: list[IterationStats] = []
            served.client.add_stats_listener(seen.append)
            outs = await collect(served.client, req("a", max_tokens=500, stop=("cde",)))
            assert "".join(o.new_text for o in outs) == "ab"
            assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_reason == "cde"
            await until(lambda: not scheduler.has_unfinished_requests())
            await until(lambda: any(s.finished for s in seen))
            assert [f.finish_reason for s in seen for f in s.finished] == [FinishReason.STOP]
    asyncio.run(main())


def test_engine_failure_errors_live_requests_then_refuses() -> None:
    async def main() -> None:
        failing = make_fake_core(runner=FakeRunner(fail_after=3, delay_s=0.001))
        async with serving(failing) as served:
            died: list[bool] = []
            served.client.add_dead_listener(lambda: died.append(True))
            with pytest.raises(EngineDeadError, match="injected runner failure"):
                await collect(served.client, req("a", max_tokens=100))
            assert died == [True] and not served.client.is_running
            with pytest.raises(EngineDeadError):
                served.client.generate(req("b"))
            await until(lambda: bool(served.errors))
    asyncio.run(main())


def test_lifeline_eof_means_engine_death() -> None:
    """kill -9 of the engine process closes its end of the lifeline: the client fails everything."""
    async def main() -> None:
        async with serving(core()) as served:
            reader, writer = multiprocessing.get_context("spawn").Pipe(duplex=False)
            client = served.client
            client._lifeline = reader
            asyncio.get_running_loop().add_reader(reader.fileno(), client._on_lifeline)
            stream = client.generate(req("a", max_tokens=1000))
            await stream.__anext__()
            writer.close()
            with pytest.raises(EngineDeadError, match="process died"):
                async for _ in stream:
                    pass
            assert not client.is_running
    asyncio.run(main())


def test_shutdown_order_aborts_what_is_live() -> None:
    async def main() -> None:
        async with serving(core()) as served:
            stream = served.client.generate(req("a", max_tokens=1000))
            await stream.__anext__()
            served.proc.input_queue.put(ShutdownEngine())
            outs = [o async for o in stream]
            assert outs[-1].finish_reason is FinishReason.ABORT
    asyncio.run(main())


def test_two_front_ends_get_their_own_outputs_and_share_the_cap() -> None:
    config = EngineConfig(scheduler=SchedulerConfig(max_num_queued_reqs=2))
    async def main() -> None:
        async with serving(core(config), config, num_clients=2, shared=make_shared_counts(2)) as served:
            first, second = served.clients
            stats: list[list[IterationStats]] = [[], []]
            first.add_stats_listener(stats[0].append)
            second.add_stats_listener(stats[1].append)
            long = first.generate(req("x", max_tokens=1000))
            await long.__anext__()
            outs = await collect(second, req("y", max_tokens=4))
            assert outs[-1].num_output_tokens == 4 and outs[-1].request_id == "y"
            other = second.generate(req("z", max_tokens=1000))  # 2 in flight across both front ends
            with pytest.raises(EngineOverloadedError):
                first.generate(req("w"))
            await other.aclose()
            await long.aclose()
            assert any(s.scheduler is not None for s in stats[0])
            assert all(s.scheduler is None for s in stats[1]) and any(s.finished for s in stats[1])
    asyncio.run(main())


def test_step_log_travels_from_the_core_and_back() -> None:
    async def main() -> None:
        async with serving(core(EngineConfig(step_log_size=64))) as served:
            await collect(served.client, req("a", max_tokens=3))
            records = await served.client.drain_step_log()
            assert records is not None and sum(r.num_decode_tokens for r in records) == 2
            assert records[0].num_prefill_reqs == 1 and records[0].num_prefill_tokens == 2
            assert await served.client.drain_step_log() == []
        async with serving(core()) as served:
            assert await served.client.drain_step_log() is None  # off by default
    asyncio.run(main())
