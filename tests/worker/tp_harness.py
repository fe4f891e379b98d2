"""Helpers for the tensor-parallel tests: a tiny dummy Llama with one (replicated) KV head, configs at a given
size, prompts, and a greedy run of an engine core to completion."""

from __future__ import annotations

import dataclasses
import random
import time

from conveyor.config import EngineConfig, ParallelConfig
from conveyor.engine.engine_core import EngineCore
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams
from conveyor.worker.tp_executor import TensorParallelExecutor

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 301,
              "max_position_embeddings": 512, "tie_word_embeddings": False, "eos_token_id": 2}


def tp(config: EngineConfig, size: int, **scheduler: object) -> EngineConfig:
    config = dataclasses.replace(config, parallel=ParallelConfig(tensor_parallel_size=size))
    return dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, **scheduler))


def prompts(num: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`num` prompts of 5 to 120 tokens: the longer ones are prefilled in chunks of the 64-token budget."""
    draw = random.Random(seed)
    return [[draw.randrange(3, vocab) for _ in range(draw.randint(5, 120))] for _ in range(num)]


def generate(core: EngineCore, token_ids: list[list[int]], max_tokens: int) -> tuple[dict[str, list[int]], int]:
    """Every prompt greedily to completion: outputs by request and the preemptions seen."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for index, ids in enumerate(token_ids):
        core.add_request(Request(f"r{index}", ids, params, arrival_s=0.0))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(token_ids))}
    num_preemptions = 0
    while core.has_unfinished_requests():
        result = core.step()
        num_preemptions += result.stats.num_preemptions
        for output in result.outputs:
            outputs[output.request_id].extend(output.new_token_ids)
    assert result.stats.kv_cache_usage == 0.0 and result.stats.num_running_reqs == 0
    return outputs, num_preemptions


def build_engine_core_around(executor: TensorParallelExecutor, config: EngineConfig) -> EngineCore:
    from conveyor.core.policies import make_scheduler
    from conveyor.engine.engine_core import ModelLimits, make_engine_core

    blocks = config.cache.num_blocks_override
    assert blocks is not None
    limits = ModelLimits(blocks, config.scheduler.max_model_len, executor.eos_token_ids, executor.vocab_size)
    return make_engine_core(config, executor, make_scheduler(config.scheduler, config.cache, blocks, time.monotonic),
                            limits)
