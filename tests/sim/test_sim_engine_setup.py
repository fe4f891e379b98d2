"""sim/engine_setup.py: the replayed engine from a run's server flags, and back."""

from __future__ import annotations

import pytest

from conveyor.config import Batching, CacheConfig, ConfigError, SchedulerConfig
from conveyor.sim.engine_setup import (
    EngineSetup,
    apply_flags,
    server_flags,
    setup_from_server_flags,
)


def test_server_flags_round_trip() -> None:
    setup = EngineSetup(SchedulerConfig(max_num_seqs=7, max_num_batched_tokens=512, long_prefill_token_threshold=64,
                                        batching=Batching.STATIC, queue_timeout_s=2.5),
                        CacheConfig(block_size=32, enable_prefix_caching=False), 321)
    assert setup_from_server_flags(server_flags(setup), "run") == setup


def test_a_vllm_servers_cache_labels_give_the_pool() -> None:
    setup = setup_from_server_flags({"num_gpu_blocks": "777", "block_size": "32", "enable_prefix_caching": "True",
                                     "engine": "0"}, "run")
    assert (setup.num_blocks, setup.cache.block_size, setup.cache.enable_prefix_caching) == (777, 32, True)
    assert setup.scheduler == SchedulerConfig()  # limits it does not report: the engine's defaults


def test_bad_flag_values_name_the_flag() -> None:
    with pytest.raises(ConfigError, match="max_num_seqs='many'"):
        setup_from_server_flags({"max_num_seqs": "many"}, "runs/a")
    with pytest.raises(ConfigError, match="num_gpu_blocks_override"):
        apply_flags(setup_from_server_flags({}, "x"), {"num_gpu_blocks_override": "0"}, "flags")
