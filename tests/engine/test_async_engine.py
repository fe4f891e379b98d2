"""AsyncEngine over fakes: streaming, cancellation frees the request, overload, crash, shutdown."""

from __future__ import annotations

import asyncio

import pytest
from engine_fakes import ByteTokenizer, FakeRunner, FakeScheduler, make_fake_core

from conveyor.config import EngineConfig, SchedulerConfig
from conveyor.engine.async_engine import AsyncEngine, build_engine_info, model_name_of
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.types import (
    EngineDeadError,
    EngineOverloadedError,
    GenerateRequest,
    RequestRejectedError,
)
from conveyor.request import FinishReason
from conveyor.sampling_params import SamplingParams


def make_async(config: EngineConfig | None = None, scheduler: FakeScheduler | None = None,
               runner: FakeRunner | None = None) -> AsyncEngine:
    # 1 ms per step: a 2000-token request stays live long enough to be aborted, cancelled or queued behind
    engine = LLMEngine(make_fake_core(config, scheduler, runner or FakeRunner(delay_s=0.001)), ByteTokenizer())
    return AsyncEngine(engine, build_engine_info(engine))


def req(request_id: str, max_tokens: int = 8, **params) -> GenerateRequest:
    return GenerateRequest(request_id, "hi", SamplingParams(max_tokens=max_tokens, **params))


async def collect(engine: AsyncEngine, request: GenerateRequest) -> list:
    return [out async for out in engine.generate(request)]


def test_concurrent_generates_complete() -> None:
    async def main() -> None:
        engine = make_async()
        results = await asyncio.gather(*(collect(engine, req(f"r{i}", max_tokens=5 + i)) for i in range(10)))
        for i, outs in enumerate(results):
            assert outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].num_output_tokens == 5 + i
        assert engine.num_unfinished_requests() == 0
        await engine.shutdown()
    asyncio.run(main())


def test_aclose_aborts_and_frees_the_request() -> None:
    async def main() -> None:
        scheduler = FakeScheduler()
        seen = []
        engine = make_async(scheduler=scheduler, runner=FakeRunner(delay_s=0.001))
        engine.add_stats_listener(lambda stats, finished: seen.append((stats, finished)))
        stream = engine.generate(req("a", max_tokens=2000))
        await stream.__anext__()
        await stream.aclose()
        for _ in range(100):
            if seen and seen[-1][0].kv_cache_usage == 0 and not scheduler.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert seen[-1][0].kv_cache_usage == 0
        assert any(f.finish_reason is FinishReason.ABORT for _, fs in seen for f in fs)
        await engine.shutdown()
    asyncio.run(main())


def test_closing_before_the_first_read_forgets_and_aborts() -> None:
    """A client that leaves right after submitting (before any output was read) leaks nothing."""
    async def main() -> None:
        scheduler = FakeScheduler()
        engine = make_async(scheduler=scheduler, runner=FakeRunner(delay_s=0.001))
        stream = engine.generate(req("a", max_tokens=2000))
        assert engine.num_unfinished_requests() == 1
        await stream.aclose()
        assert engine.num_unfinished_requests() == 0
        for _ in range(200):
            if not scheduler.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert not scheduler.has_unfinished_requests()
        await engine.shutdown()
    asyncio.run(main())


def test_cancelled_consumer_aborts() -> None:
    async def main() -> None:
        scheduler = FakeScheduler()
        engine = make_async(scheduler=scheduler, runner=FakeRunner(delay_s=0.001))
        task = asyncio.create_task(collect(engine, req("a", max_tokens=2000)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if not scheduler.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert not scheduler.has_unfinished_requests()
        await engine.shutdown()
    asyncio.run(main())


def test_queue_full_raises_before_any_output() -> None:
    async def main() -> None:
        config = EngineConfig(scheduler=SchedulerConfig(max_num_queued_reqs=2))
        engine = make_async(config, scheduler=FakeScheduler(max_running=1))
        streams = [engine.generate(req("r0", max_tokens=2000))]
        await streams[0].__anext__()  # r0 runs; the one running slot is taken
        streams += [engine.generate(req(f"r{i}", max_tokens=2000)) for i in (1, 2)]  # both wait
        with pytest.raises(EngineOverloadedError, match="--max-num-queued-reqs"):
            engine.generate(req("r3"))
        for stream in streams:
            await stream.aclose()
        await engine.shutdown()
    asyncio.run(main())


def test_too_long_rejected_synchronously() -> None:
    async def main() -> None:
        engine = make_async(EngineConfig(scheduler=SchedulerConfig(max_model_len=16, max_num_batched_tokens=128)))
        with pytest.raises(RequestRejectedError) as info:
            engine.generate(req("a", max_tokens=15))
        assert info.value.field == "max_tokens"
        await engine.shutdown()
    asyncio.run(main())


def test_queue_timeout_reaches_the_stream() -> None:
    async def main() -> None:
        config = EngineConfig(scheduler=SchedulerConfig(queue_timeout_s=0.1))
        engine = make_async(config, scheduler=FakeScheduler(max_running=1, queue_timeout_s=0.1),
                            runner=FakeRunner(delay_s=0.002))
        blocker = engine.generate(req("a", max_tokens=2000))
        await blocker.__anext__()
        outs = await collect(engine, req("b"))
        assert outs[-1].finish_reason is FinishReason.QUEUE_TIMEOUT and "--queue-timeout" in outs[-1].error_message
        await blocker.aclose()
        await engine.shutdown()
    asyncio.run(main())


def test_stop_string_ends_with_stop() -> None:
    async def main() -> None:
        engine = make_async()
        outs = await collect(engine, req("a", max_tokens=50, stop=("d",)))
        assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_reason == "d"
        assert "".join(o.new_text for o in outs) == "abc"
        await engine.shutdown()
    asyncio.run(main())


def test_crash_errors_live_requests_then_dead() -> None:
    async def main() -> None:
        engine = make_async(runner=FakeRunner(fail_after=3))
        outs = await collect(engine, req("a", max_tokens=50))
        assert outs[-1].finish_reason is FinishReason.ERROR and "injected" in outs[-1].error_message
        await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError):
            engine.generate(req("b"))
        await engine.shutdown()
    asyncio.run(main())


def test_shutdown_aborts_live_and_refuses_new() -> None:
    async def main() -> None:
        engine = make_async()
        stream = engine.generate(req("a", max_tokens=2000))
        await stream.__anext__()
        await engine.shutdown()
        rest = [o async for o in stream]
        assert rest[-1].finish_reason is FinishReason.ABORT
        with pytest.raises(EngineDeadError):
            engine.generate(req("b"))
    asyncio.run(main())


def test_info_and_tokenizer_passthrough() -> None:
    async def main() -> None:
        engine = make_async()
        assert engine.info.max_model_len == 2048 and engine.info.config["batching"] == "continuous"
        assert engine.detokenize(engine.tokenize("héllo")) == "héllo"
        await engine.shutdown()
    asyncio.run(main())


def test_model_name_derivation() -> None:
    from conveyor.config import ModelConfig
    assert model_name_of(EngineConfig(model=ModelConfig(model="/m/Foo.Q4.gguf"))) == "Foo.Q4"
    assert model_name_of(EngineConfig(model=ModelConfig(model="/models/Llama-3/"))) == "Llama-3"
    assert model_name_of(EngineConfig(model=ModelConfig(served_model_name="x"))) == "x"


def test_request_of_a_closed_event_loop_is_aborted() -> None:
    scheduler = FakeScheduler()
    engine = make_async(scheduler=scheduler, runner=FakeRunner(delay_s=0.001))

    async def start_and_leave() -> None:
        stream = engine.generate(req("a", max_tokens=2000))
        await stream.__anext__()  # then the loop closes with the stream still open

    asyncio.run(start_and_leave())

    async def wait_until_free() -> None:
        for _ in range(200):
            if not scheduler.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert not scheduler.has_unfinished_requests()
        await engine.shutdown()

    asyncio.run(wait_until_free())
