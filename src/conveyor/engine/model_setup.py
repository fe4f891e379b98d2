"""Start-up: load the model runner, size the KV cache, build the scheduler over the same blocks.

Order matters: the runner loads the weights (which fixes the model's max positions and KV geometry),
then sizes and allocates the KV cache from the memory budget; only then can the scheduler's block
pool be built with exactly that many blocks. `max_model_len` is resolved here: the configured value
(SchedulerConfig's default 2048 unless --max-model-len is given) capped by the model's
`max_position_embeddings`, so a request can never run past the positions the model was trained for;
the scheduler is built with the resolved value so admission and the runner agree. Speculative decoding
(`--speculative-config`) goes to both: the runner builds the proposer (and loads a draft model), the
scheduler schedules the drafts and reserves the draft model's lookahead slots. With
--tensor-parallel-size N > 1 the runner is a `TensorParallelExecutor` (rank 0 here, ranks 1 .. N-1
in processes of their own, worker/tp_executor.py); the rest of start-up is the same.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from conveyor.config import EngineConfig, ModelConfig
from conveyor.core.lifecycle import EosTokenIds
from conveyor.engine.args import engine_config_to_flags, with_overrides
from conveyor.engine.engine_core import EngineCore, ModelLimits, make_engine_core
from conveyor.engine.model_files import model_path, tokenizer_path
from conveyor.engine.types import EngineInfo

if TYPE_CHECKING:
    from conveyor.engine.tokenizer import Tokenizer
    from conveyor.worker.tp_executor import RankFailure

logger = logging.getLogger(__name__)


def build_engine_core(config: EngineConfig, clock: Callable[[], float] = time.monotonic,
                      on_rank_failure: Callable[[RankFailure], None] | None = None) -> EngineCore:
    """Load the model, size the KV cache, then build the scheduler over the same number of blocks.
    `on_rank_failure` is called (on a monitor thread) if a tensor-parallel rank dies."""
    from conveyor.core.policies import make_scheduler

    if config.cache.cache_dtype != "auto":
        logger.info("KV cache dtype %s (--kv-cache-dtype): one byte per element, k_scale = v_scale = 1.0 (vLLM's "
                    "default without calibrated scales); it may cost accuracy", config.cache.cache_dtype)
    tokenizer = read_tokenizer(config.model)
    runner = make_runner(config, tokenizer, on_rank_failure)
    max_model_len = min(config.scheduler.max_model_len, runner.max_position_embeddings)
    if max_model_len < config.scheduler.max_model_len:
        logger.warning("max_model_len lowered from %d to the model's max_position_embeddings %d",
                       config.scheduler.max_model_len, max_model_len)
        config = with_overrides(config, "scheduler", max_model_len=max_model_len)
    capacity = runner.initialize_kv_cache()
    scheduler = make_scheduler(config.scheduler, config.cache, capacity.num_blocks, clock, config.speculative_config)
    limits = ModelLimits(num_kv_blocks=capacity.num_blocks, max_model_len=max_model_len,
                         eos_token_ids=tuple(runner.eos_token_ids), vocab_size=runner.vocab_size,
                         tokenizer_eos_token_id=_eos_of(tokenizer))
    num_ranks = config.parallel.tensor_parallel_size
    per_rank = f" per rank of {num_ranks}" if num_ranks > 1 else ""
    logger.info("KV cache%s: %d blocks x %d tokens = %d tokens (%.1f MiB), max concurrency %.1f at "
                "max_model_len=%d", per_rank, capacity.num_blocks, capacity.block_size, capacity.num_tokens,
                capacity.num_bytes / 2**20, capacity.max_concurrency, max_model_len)
    return make_engine_core(config, runner, scheduler, limits)


def read_tokenizer(model_config: ModelConfig) -> Tokenizer | None:
    """The tokenizer the front end serves with, for its EOS (the primary one, as in vLLM) and its
    vocabulary; None when it cannot be read (logged): the engine still starts, stopping on the model's
    EOS ids alone, and each constrained request then fails on its own (the front end reports the rest)."""
    from conveyor.engine.tokenizer import Tokenizer

    try:
        return Tokenizer.from_path(tokenizer_path(model_config))
    except Exception as error:  # noqa: BLE001 - a missing or unsupported tokenizer must not stop start-up
        logger.warning("the tokenizer could not be read (%s); EOS comes from the model's files alone", error)
        return None


def _eos_of(tokenizer: Tokenizer | None) -> int | None:
    return None if tokenizer is None else tokenizer.eos_token_id


def make_runner(config: EngineConfig, tokenizer: Tokenizer | None = None,
                on_rank_failure: Callable[[RankFailure], None] | None = None) -> Any:
    """The model runner, or with --tensor-parallel-size > 1 the executor that drives every rank's.
    Structured outputs are a single-rank feature: every rank samples and keeps its own token history, so
    a grammar mask on rank 0 alone would split the ranks' inputs; the front end refuses constrained
    requests under tensor parallelism instead (engine/admission.py)."""
    if config.parallel.tensor_parallel_size > 1:
        from conveyor.worker.tp_executor import TensorParallelExecutor

        return TensorParallelExecutor(config, on_rank_failure)
    from conveyor.worker.model_runner import ModelRunner

    runner = ModelRunner(config.model, config.cache, config.scheduler, config.device, config.speculative_config)
    eos = EosTokenIds.resolve(_eos_of(tokenizer), runner.eos_token_ids)
    runner.structured_outputs = structured_outputs_for(config.model, tokenizer, runner.vocab_size, eos)
    return runner


def structured_outputs_for(model_config: ModelConfig, tokenizer: Tokenizer | None,  # noqa: ANN201
                           vocab_size: int, eos: EosTokenIds):
    """The worker's grammar matchers over this model's tokenizer (indexed before serving). A complete
    grammar allows only its end tokens, so they are exactly the EOS ids the engine stops on that the
    tokenizer knows (llguidance refuses others): the sampled end token then always ends the request."""
    from conveyor.engine.tokenizer import Tokenizer
    from conveyor.worker.structured_output import GrammarVocab, StructuredOutputs

    def tokenizer_json() -> str:  # re-read (raising the reason) only when it failed at start-up
        return (tokenizer or Tokenizer.from_path(tokenizer_path(model_config))).backend.to_str()

    known = eos.all if tokenizer is None else tuple(i for i in eos.all if i < tokenizer.vocab_size)
    if not known:
        logger.warning("no EOS id the engine stops on is in the tokenizer's vocabulary (EOS %s): a completed "
                       "grammar may end on a token that does not stop its request", list(eos.all))
    return StructuredOutputs(GrammarVocab(tokenizer_json, vocab_size, known))


def core_side_config(config: EngineConfig) -> EngineConfig:
    """The configuration the engine core runs with: the admission caps are the front end's alone
    (decided once, there), so the scheduler never applies a queue bound of its own."""
    return with_overrides(config, "scheduler", max_num_queued_reqs=None, max_num_queued_tokens=None)


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""Name of the embedded model (used when neither --served-model-name nor --model is given)."""


def model_name_of(config: EngineConfig) -> str:
    """--served-model-name, else the model file's stem or directory's name."""
    if config.model.served_model_name:
        return config.model.served_model_name
    if config.model.model is None:
        return DEFAULT_MODEL_NAME
    path = PurePath(config.model.model.rstrip("/\\"))
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def build_engine_info(core: EngineCore, config: EngineConfig) -> EngineInfo:
    """What start-up resolved, for the front ends; `config` is the user's (caps included)."""
    limits = core.limits
    flags = engine_config_to_flags(config)
    flags["max-model-len"] = str(limits.max_model_len)
    return EngineInfo(model_name=model_name_of(config), max_model_len=limits.max_model_len,
                      block_size=config.cache.block_size, num_kv_blocks=limits.num_kv_blocks,
                      vocab_size=limits.vocab_size, config=flags, model_path=str(model_path(config.model)),
                      device_name=_device_name(config.device.device), dtype=_dtype_name(core))


def _dtype_name(core: EngineCore) -> str | None:
    """The model runner's resolved dtype without the `torch.` prefix (None for runners without one)."""
    dtype = getattr(core.runner, "dtype", None)  # ModelRunner has it; the Runner protocol does not require it
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _device_name(device: str) -> str:
    """"cpu", or the CUDA device's name as torch reports it."""
    if device != "cuda":
        return "cpu"
    import torch  # the engine process has loaded it already

    return str(torch.cuda.get_device_name())
