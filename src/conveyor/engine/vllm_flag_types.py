"""The vocabulary of the `vllm serve` flag table (engine/vllm_flag_table.py): a flag's statuses, how it
takes its value, one row, and the reasons the rows share. Data only; stdlib only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FlagStatus(enum.Enum):
    IMPLEMENTED = "implemented"
    IGNORED = "ignored"
    DEFAULT_ONLY = "default only"
    UNSUPPORTED = "unsupported"


class Arity(enum.Enum):
    """How the flag takes its value (as vLLM's argparse declares it)."""

    SWITCH = "switch"
    """`--x` alone (store_true)."""
    BOOL = "bool"
    """`--x` / `--no-x`."""
    VALUE = "value"
    """`--x V`."""
    VALUES = "values"
    """`--x V [V ...]`."""


@dataclass(frozen=True)
class VllmFlag:
    """One `vllm serve` flag and conveyor's answer to it."""

    names: tuple[str, ...]
    """Its spellings, long name first (`--tensor-parallel-size`, `-tp`); `--no-x` is implied by BOOL."""
    arity: Arity
    """How it takes a value."""
    status: FlagStatus
    """What conveyor does with it."""
    note: str
    """Why (IGNORED, DEFAULT_ONLY, UNSUPPORTED) or how conveyor's meaning differs (IMPLEMENTED)."""
    defaults: tuple[str, ...] = ()
    """DEFAULT_ONLY: the values that are no-ops (vLLM's default; `false` for a BOOL means `--no-x`)."""

    @property
    def name(self) -> str:
        return self.names[0]


HUB = "no model hub here: models are local HF directories or GGUF files"
LOGS = "a logging/tracing option with no counterpart in conveyor"
MM = "multimodal inputs: conveyor serves text-only models"
MAMBA = "Mamba/SSM state: conveyor serves attention-only models"
LORA = "LoRA adapters are not supported"
PARALLEL = "conveyor runs one engine-core process: no data/pipeline/context/expert parallelism"
KERNELS = "kernel and backend choices: conveyor picks its own kernels"
MOE = "mixture-of-experts models are not supported"
TOOLS = "tool calling and reasoning parsers are not supported"
LOADING = "weight-loading tuning: conveyor's loader reads safetensors/GGUF its own way"
OFFLOAD = "weight/KV offloading is not supported"
KV_TRANSFER = "disaggregated prefill / KV and encoder transfer are not supported"
PLUGINS = "loading user code (plugins, classes, middleware) is not supported"
OTHER_APIS = "that API (Cohere, Anthropic, gRPC, ...) is not served by conveyor"
POOLING = "pooling/embedding models are not served"
SLEEP = "sleep mode is not supported"
FEATURE = "not supported by conveyor's engine"


def flag_row(names: str, arity: Arity, status: FlagStatus, note: str, *defaults: str) -> VllmFlag:
    """One row: `names` comma-separated (`"--tensor-parallel-size,-tp"`), then the VllmFlag fields."""
    return VllmFlag(tuple(names.split(",")), arity, status, note, tuple(defaults))
