"""The engine core logs each step's batch and wall time when --step-log-size asks, and nothing otherwise."""

from __future__ import annotations

from engine_fakes import FakeRunner, make_fake_core

from conveyor.config import EngineConfig
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams


def run_two_requests(config: EngineConfig):  # noqa: ANN201
    core = make_fake_core(config, runner=FakeRunner(delay_s=0.002))
    core.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=3), 0.0))
    core.add_request(Request("b", [5, 6], SamplingParams(max_tokens=3), 0.0))
    while core.has_unfinished_requests():
        core.step()
    return core


def test_each_step_is_logged_with_its_composition_and_time() -> None:
    core = run_two_requests(EngineConfig(step_log_size=100))
    records = core.drain_step_log()
    assert records is not None and len(records) == 3
    prefill, *decodes = records
    assert (prefill.num_prefill_tokens, prefill.num_prefill_reqs, prefill.num_decode_tokens) == (5, 2, 0)
    assert all((d.num_decode_tokens, d.num_decode_reqs, d.num_prefill_tokens) == (2, 2, 0) for d in decodes)
    assert [d.num_context_tokens for d in decodes] == [4 + 3, 5 + 4]
    assert all(r.step_time_s >= 0.002 for r in records)  # the runner sleeps 2 ms: the step's time includes it
    assert records[0].start_s < records[1].start_s < records[2].start_s
    assert core.drain_step_log() == []  # drained


def test_off_by_default_nothing_is_recorded() -> None:
    core = run_two_requests(EngineConfig())
    assert core.step_log is None and core.drain_step_log() is None


def test_the_offline_llm_accepts_the_size_by_name() -> None:
    from conveyor.engine.llm import engine_config_from_kwargs

    assert engine_config_from_kwargs(step_log_size=8).step_log_size == 8


def test_a_negative_size_is_refused_naming_the_flag() -> None:
    import argparse

    import pytest

    from conveyor.config import ConfigError
    from conveyor.engine.args import add_engine_arguments, build_engine_config

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    with pytest.raises(ConfigError, match="step.log.size"):
        build_engine_config(parser.parse_args(["--step-log-size", "-1"]))
