"""How one front end reaches its engine core: the addresses, the admission limits and the core's own
report of what it resolved at start-up (kept apart from core_client.py, which runs the connection)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from conveyor.config import EngineConfig
from conveyor.core.lifecycle import KVPoolSize
from conveyor.engine.admission import RequestLimits
from conveyor.engine.core_proc import EngineAddresses
from conveyor.engine.grammar_check import GrammarLimits
from conveyor.engine.types import EngineInfo


@dataclass(frozen=True)
class ClientConfig:
    """How one front end reaches its engine core."""

    info: EngineInfo
    """What the core resolved at start-up (its READY handshake)."""
    limits: RequestLimits
    """The per-request admission limits."""
    addresses: EngineAddresses
    """The core's sockets."""
    client_index: int = 0
    """This front end's identity toward the core (its output socket is addresses.outputs[i])."""
    queue_timeout_s: float | None = None
    """--queue-timeout, for the error message of a timed-out request."""
    chat_template: str | None = None
    """A Jinja chat template replacing the model's (--chat-template), else None."""
    grammar: GrammarLimits = GrammarLimits()
    """What a structured-outputs constraint may cost (--max-grammar-bytes, ...)."""


    @classmethod
    def for_engine(cls, engine_config: EngineConfig, info: EngineInfo, addresses: EngineAddresses,
                   client_index: int = 0) -> ClientConfig:
        """The client configuration for front end `client_index` of an engine that reported `info`."""
        scheduler = dataclasses.replace(engine_config.scheduler, max_model_len=info.max_model_len)
        limits = RequestLimits(scheduler, KVPoolSize(info.num_kv_blocks, info.block_size), info.vocab_size,
                               speculative=engine_config.speculative_config is not None,
                               tensor_parallel=engine_config.parallel.tensor_parallel_size > 1)
        return cls(info, limits, addresses, client_index, engine_config.scheduler.queue_timeout_s)
