"""The real Scheduler driving the ModelRunner on the tiny dummy Llama: greedy outputs must not depend
on chunked prefill, prefix caching, preemptions forced by a small KV pool, or the batching policy."""

from __future__ import annotations

import pathlib

import pytest
from runner_harness import BLOCK_SIZE, make_runner, write_tiny_llama

from conveyor.config import Batching, CacheConfig, SchedulerConfig
from conveyor.core.policies import make_scheduler
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams

SHARED_PREFIX = [(5 * i + 7) % 250 + 3 for i in range(12)]
PROMPTS = [SHARED_PREFIX + [(3 * i + j) % 250 + 3 for i in range(n)] for j, n in enumerate([9, 1, 17, 4, 22, 6])]
PARAMS = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-sched"))


def generate(model_dir: pathlib.Path, num_blocks: int, max_num_batched_tokens: int,
             enable_prefix_caching: bool, batching: Batching = Batching.CONTINUOUS) -> tuple[dict[str, list[int]], int]:
    """Run all PROMPTS to completion; returns the outputs and the number of preemptions."""
    scheduler_config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=max_num_batched_tokens,
                                       max_model_len=64, batching=batching)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching,
                               num_blocks_override=num_blocks)
    scheduler = make_scheduler(scheduler_config, cache_config, num_blocks)
    runner = make_runner(model_dir, num_blocks=num_blocks, max_model_len=scheduler_config.max_model_len)
    for index, prompt in enumerate(PROMPTS):
        scheduler.add_request(Request(f"r{index}", prompt, PARAMS, arrival_s=0.0, eos_token_id=2))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    num_preemptions = 0
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        scheduler_output = scheduler.schedule()
        core_outputs, stats = scheduler.update_from_output(scheduler_output, runner.execute(scheduler_output))
        scheduler.check_invariants()
        num_preemptions += stats.num_preemptions
        for output in core_outputs:
            outputs[output.request_id].extend(output.new_token_ids)
    assert not scheduler.has_unfinished_requests()
    return outputs, num_preemptions


def test_greedy_outputs_survive_preemption_chunking_and_prefix_caching(model_dir: pathlib.Path) -> None:
    reference, reference_preemptions = generate(model_dir, num_blocks=256, max_num_batched_tokens=512,
                                                enable_prefix_caching=False)
    assert reference_preemptions == 0
    assert all(len(tokens) == PARAMS.max_tokens for tokens in reference.values())
    tight, tight_preemptions = generate(model_dir, num_blocks=24, max_num_batched_tokens=16,
                                        enable_prefix_caching=True)
    assert tight_preemptions > 0, "the pool was meant to be small enough to force preemptions"
    assert tight == reference
    cached, _ = generate(model_dir, num_blocks=256, max_num_batched_tokens=32, enable_prefix_caching=True)
    assert cached == reference
    static, _ = generate(model_dir, num_blocks=256, max_num_batched_tokens=512, enable_prefix_caching=True,
                         batching=Batching.STATIC)
    assert static == reference
