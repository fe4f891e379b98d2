"""vllm:cache_config_info: vLLM 0.32's cache-configuration info gauge, with its exact label names.

vLLM renders `str(value)` of every CacheConfig field, plus `engine`. conveyor fills the fields it has
from the engine's resolved configuration; those naming features it does not have (Mamba state, KV
offloading, sliding window, hash algorithms) are "None" or "False", as vLLM renders them unset.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from conveyor.config import CacheConfig
from conveyor.engine.types import EngineInfo
from conveyor.server.metric_families import ENGINE_INDEX

UNSET_FIELDS = ("kv_cache_dtype_skip_layers", "kv_cache_layout", "kv_offloading_backend", "kv_offloading_size",
                "mamba_block_size", "mamba_cache_dtype", "mamba_cache_mode", "mamba_page_size_padded",
                "mamba_ssm_cache_dtype", "prefix_cache_retention_interval", "prefix_match_unit",
                "replayssm_buffer_len", "sliding_window", "num_cpu_blocks")
"""Fields of features conveyor lacks: "None", as vLLM shows them when unset."""
FALSE_FIELDS = ("enable_mamba_shared_prefix_checkpoint", "is_attention_free", "kv_sharing_fast_prefill",
                "skip_page_size_padded", "swa_bounded_replay", "use_kda_recoverssm", "use_replayssm")
"""Boolean features conveyor lacks: "False"."""


def _flag(info: EngineInfo, key: str) -> str:
    value = info.config.get(key, "none")
    return {"none": "None", "true": "True", "false": "False"}.get(value, value)


def cache_config_labels(info: EngineInfo) -> dict[str, str]:
    """The label values, keyed by vLLM's CacheConfig field names."""
    block = str(info.block_size)
    user_block = info.block_size != CacheConfig().block_size  # inferred: vLLM's default is conveyor's (16)
    memory = _flag(info, "kv-cache-memory")
    labels = {name: "None" for name in UNSET_FIELDS} | {name: "False" for name in FALSE_FIELDS}
    labels.update({
        "_block_size_resolved": "True", "block_size": block, "user_specified_block_size": str(user_block),
        "effective_attention_block_size": block, "hash_block_size": block, "cache_hit_alignment_tokens": block,
        "cache_dtype": info.config.get("kv-cache-dtype", "auto"),
        "enable_prefix_caching": _flag(info, "enable-prefix-caching"),
        "gpu_memory_utilization": _flag(info, "gpu-memory-utilization"), "kv_cache_memory_bytes": memory,
        "num_gpu_blocks": str(info.num_kv_blocks), "num_gpu_blocks_override": _flag(info, "num-gpu-blocks-override"),
        "kv_cache_size_tokens": str(info.num_kv_tokens), "kv_cache_max_concurrency": f"{info.max_concurrency:.2f}",
        "prefix_caching_hash_algo": "sha256", "engine": ENGINE_INDEX,
    })
    return labels


def add_cache_config_info(registry: CollectorRegistry, info: EngineInfo) -> None:
    labels = cache_config_labels(info)
    gauge = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", sorted(labels),
                  registry=registry, multiprocess_mode="mostrecent")
    gauge.labels(**labels).set(1)
