"""GPU memory plan: does a model, at a concurrency and context length, fit on a GPU, and with what headroom.

The model (per GPU; with tensor parallel size `tp` every term is that of the largest rank's shard,
`shape_per_rank`, split as `conveyor serve` splits it: KV heads in contiguous runs -- ceil(kv / tp) on
the first rank, one replicated head when kv < tp -- with their query heads, ceil(intermediate / tp)
MLP columns, ceil(vocab / tp) embedding and LM-head rows; norms replicated):
  usable      = total × gpu_memory_utilization        (the rest is the safety margin, as vLLM's flag)
  weights     = shard parameters × dtype bytes, parameters counted from config.json: embeddings (and an
                untied LM head), per layer q/k/v/o projections with GQA and head_dim, optional biases,
                Qwen3's per-head q/k norms, the gated MLP (3 matrices), two RMSNorms; one final norm
  overhead    = the larger of the activations of one forward of `max_num_batched_tokens` tokens (only
                one layer's intermediates live at a time: ~4×hidden + q/k/v + 2×intermediate values per
                token) and the sampler's reserve for min(max_num_seqs, token budget) rows
                (`sampler_bytes`: 8 bytes per logit for the whole batch + the staged path's row-chunk
                temporaries, 48 bytes per logit up to ~251 MB; measured) + a fixed runtime allowance
                (CUDA context, allocator slack, CUDA graphs: 1 GiB, 0.5 GiB with enforce-eager)
  kv_budget   = usable − weights − overhead
  kv_per_token = 2 (K and V) × layers × the shard's kv_heads × head_dim × kv dtype bytes
  kv_needed   = concurrency × ceil(context / block_size) × block_size × kv_per_token
A GPU fits when kv_budget ≥ kv_needed; max concurrency = floor(kv_budget / per-request KV). The overhead
is an estimate (vLLM measures it by profiling); it is the term to distrust first on a tight fit.
The `kv_capacity` mode instead reproduces `conveyor serve`'s own arithmetic for a given KV budget:
blocks = floor(bytes / (2 × layers × block_size × kv_heads × head_dim × dtype bytes)); under tensor
parallelism the budget is per rank and the shard's kv_heads count (the engine takes the group's
minimum block count, which is the largest shard's).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from conveyor.bench.plan.gpu_catalog import GPU
from conveyor.bench.plan.sampler_memory import sampler_bytes

FP8_METHODS = ("fp8", "ptpc_fp8")
"""serve's --quantization values that store the projections in FP8."""
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}
"""Bytes per element; the fp8 spellings are `--kv-cache-dtype`'s (`auto`: the weights' dtype)."""
_RUNTIME_BYTES = 1 << 30
_RUNTIME_EAGER_BYTES = 1 << 29


class PlanError(ValueError):
    """A config.json or plan input that cannot be planned; says which field."""


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise PlanError(f"--dtype must be one of {sorted(DTYPE_BYTES)} (got {dtype!r})")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ModelShape:
    """The config.json fields the plan needs."""

    model_type: str
    """e.g. llama, qwen3."""
    vocab_size: int
    """Embedding rows."""
    hidden_size: int
    """Residual width."""
    intermediate_size: int
    """MLP width."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA)."""
    head_dim: int
    """Channels per head."""
    tie_word_embeddings: bool
    """LM head shares the embedding matrix."""
    attention_bias: bool
    """q/k/v (and o) projections carry biases."""
    mlp_bias: bool
    """MLP projections carry biases."""
    max_position_embeddings: int
    """Longest context the model was trained for."""
    stored_fp8: bool = False
    """quantization_config.quant_method is "fp8": serve loads the projections in FP8 (one byte) unasked."""


def _int(value: object, key: str, origin: str) -> int:
    """int() of a number or numeric string, as config.json files hold them; a PlanError naming the field else."""
    try:
        if isinstance(value, (int, float, str)):
            return int(value)
    except (ValueError, OverflowError):
        pass
    raise PlanError(f"{origin}: config.json field {key!r} must be a number (got {value!r})")


def _require(config: Mapping[str, object], key: str, origin: str) -> int:
    if key not in config:
        raise PlanError(f"{origin}: config.json lacks {key!r}")
    return _int(config[key], key, origin)


def _optional(config: Mapping[str, object], key: str, origin: str) -> int:
    """config[key], else 0 when it is absent or null (HF configs leave such fields out or null)."""
    value = config.get(key)
    return _int(value, key, origin) if value else 0


def _flag(config: Mapping[str, object], key: str) -> bool:
    return bool(config.get(key, False))


def _text(config: Mapping[str, object], key: str, default: str) -> str:
    return str(config.get(key, default))


def shape_from_config(config: Mapping[str, object], origin: str = "config.json") -> ModelShape:
    """Read a Hugging Face decoder config (Llama/Qwen/Mistral family): the one parse of config.json."""
    hidden = _require(config, "hidden_size", origin)
    heads = _require(config, "num_attention_heads", origin)
    return ModelShape(
        model_type=_text(config, "model_type", "unknown"),
        vocab_size=_require(config, "vocab_size", origin),
        hidden_size=hidden,
        intermediate_size=_require(config, "intermediate_size", origin),
        num_layers=_require(config, "num_hidden_layers", origin),
        num_heads=heads,
        num_kv_heads=_optional(config, "num_key_value_heads", origin) or heads,
        head_dim=_optional(config, "head_dim", origin) or hidden // heads,
        tie_word_embeddings=_flag(config, "tie_word_embeddings"),
        attention_bias=_flag(config, "attention_bias"),
        mlp_bias=_flag(config, "mlp_bias"),
        max_position_embeddings=_optional(config, "max_position_embeddings", origin),
        stored_fp8=_quant_method(config) == "fp8",
    )


def _quant_method(config: Mapping[str, object]) -> object:
    quant = config.get("quantization_config")
    return quant.get("quant_method") if isinstance(quant, Mapping) else None


def load_shape(path: pathlib.Path) -> ModelShape:
    """A config.json file, or a model directory holding one."""
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise PlanError(f"--config: {file} does not exist (give a config.json or a directory with one)")
    config: object = json.loads(file.read_text())
    if not isinstance(config, dict):
        raise PlanError(f"{file}: config.json must be a JSON object")
    return shape_from_config(config, str(file))


@dataclass(frozen=True)
class ParameterCount:
    """Parameters by part; total is their sum."""

    embedding: int
    """Token embedding matrix."""
    lm_head: int
    """Output projection (0 when tied)."""
    attention: int
    """All layers' q/k/v/o (+ biases, + q/k norms)."""
    mlp: int
    """All layers' gate/up/down (+ biases)."""
    norms: int
    """All RMSNorm weights."""

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.attention + self.mlp + self.norms


def count_parameters(shape: ModelShape) -> ParameterCount:
    h, layers = shape.hidden_size, shape.num_layers
    q_dim = shape.num_heads * shape.head_dim
    kv_dim = shape.num_kv_heads * shape.head_dim
    attention = h * q_dim + 2 * h * kv_dim + q_dim * h
    if shape.attention_bias:
        attention += q_dim + 2 * kv_dim
    qk_norm = 2 * shape.head_dim if shape.model_type.startswith("qwen3") else 0
    mlp = 3 * h * shape.intermediate_size
    if shape.mlp_bias:
        mlp += 2 * shape.intermediate_size + h
    embedding = shape.vocab_size * h
    return ParameterCount(
        embedding=embedding,
        lm_head=0 if shape.tie_word_embeddings else embedding,
        attention=layers * (attention + qk_norm),
        mlp=layers * mlp,
        norms=layers * 2 * h + h,
    )


def shape_per_rank(shape: ModelShape, tensor_parallel_size: int) -> ModelShape:
    """The largest rank's shard as a model shape (rank 0's: uneven splits give the first ranks the extra
    head, column or row). tensor_parallel_size 1 is the shape itself."""
    tp = tensor_parallel_size
    if tp == 1:
        return shape
    if tp > shape.num_heads or (shape.num_kv_heads < tp and tp % shape.num_kv_heads):
        raise PlanError(f"--tensor-parallel-size {tp} cannot split {shape.num_heads} heads / {shape.num_kv_heads} KV "
                        f"heads: use at most {shape.num_heads} ranks, and a multiple of {shape.num_kv_heads} above "
                        f"{shape.num_kv_heads} (the engine refuses the same)")
    group = shape.num_heads // shape.num_kv_heads
    if shape.num_kv_heads >= tp:
        kv_heads = math.ceil(shape.num_kv_heads / tp)
        heads = kv_heads * group
    else:  # each KV head replicated on tp / kv ranks, which share its query heads
        kv_heads = 1
        heads = math.ceil(group / (tp // shape.num_kv_heads))
    return dataclasses.replace(shape, num_heads=heads, num_kv_heads=kv_heads,
                               vocab_size=math.ceil(shape.vocab_size / tp),
                               intermediate_size=math.ceil(shape.intermediate_size / tp))


def kv_bytes_per_token(shape: ModelShape, kv_dtype_bytes: int) -> int:
    """K and V of one token over all layers: 2 × layers × kv_heads × head_dim × dtype bytes."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * kv_dtype_bytes


@dataclass(frozen=True)
class PlanInputs:
    """What the plan is asked about."""

    dtype: str = "bfloat16"
    """Weight dtype."""
    kv_cache_dtype: str | None = None
    """KV cache dtype, as serve's --kv-cache-dtype (None or auto: same as dtype)."""
    max_num_seqs: int = 64
    """Expected concurrency: requests holding KV at once."""
    context_len: int = 8192
    """Target context length per request (prompt + output), tokens."""
    max_num_batched_tokens: int = 8192
    """Token budget of one step (sizes the activation term)."""
    block_size: int = 16
    """KV block size (a request's KV rounds up to whole blocks)."""
    gpu_memory_utilization: float = 0.92
    """Fraction of the GPU the engine may use; the rest is the safety margin."""
    tensor_parallel_size: int = 1
    """GPUs the model is split over (see `shape_per_rank`)."""
    enforce_eager: bool = False
    """No CUDA graphs: smaller runtime allowance."""
    quantization: str | None = None
    """serve's --quantization: fp8 / ptpc_fp8 store the decoder projections in one byte a weight (None: dtype)."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "context_len", "max_num_batched_tokens", "block_size", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise PlanError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise PlanError(f"--gpu-memory-utilization must be in (0, 1] (got {self.gpu_memory_utilization})")
        dtype_bytes(self.dtype)
        dtype_bytes(self.kv_dtype)
        if self.quantization not in (None, "none", *FP8_METHODS):
            raise PlanError(f"--quantization must be none, fp8 or ptpc_fp8 (got {self.quantization!r})")

    @property
    def kv_dtype(self) -> str:
        """The KV cache's dtype with auto resolved to the weights'."""
        return self.dtype if self.kv_cache_dtype in (None, "auto") else self.kv_cache_dtype


@dataclass(frozen=True)
class ModelMemory:
    """GPU-independent terms, per GPU of the tensor-parallel group."""

    num_parameters: int
    """All parameters of the model."""
    weights_bytes: int
    """Weights on one GPU."""
    kv_bytes_per_token: int
    """KV of one token on one GPU."""
    kv_bytes_per_request: int
    """KV of one request at the target context, whole blocks."""
    kv_needed_bytes: int
    """KV of `max_num_seqs` such requests."""
    activation_bytes: int
    """Estimated peak activations + logits of one step."""
    runtime_bytes: int
    """Fixed allowance: CUDA context, allocator slack, CUDA graphs."""


def weights_bytes(params: ParameterCount, inputs: PlanInputs) -> int:
    """All parameters at the weights' dtype, except under --quantization fp8 the projections (attention
    and MLP, their few bias and q/k-norm values included) at one byte each."""
    if inputs.quantization not in FP8_METHODS:  # ptpc_fp8's per-channel scales: 4 bytes a row, not counted
        return params.total * dtype_bytes(inputs.dtype)
    kept = params.embedding + params.lm_head + params.norms
    return kept * dtype_bytes(inputs.dtype) + params.attention + params.mlp


def model_memory(shape: ModelShape, inputs: PlanInputs,
                 sampler_reserve: Callable[[int, int], int] = sampler_bytes) -> ModelMemory:
    """The plan's terms; `sampler_reserve(rows, vocab_size)`: the sampler's peak (the engine's today by
    default, `unchunked_sampler_bytes` for counts measured before the sampler went through row chunks)."""
    rank = shape_per_rank(shape, inputs.tensor_parallel_size)
    kv_token = kv_bytes_per_token(rank, dtype_bytes(inputs.kv_dtype))
    blocks = math.ceil(inputs.context_len / inputs.block_size)
    per_request = blocks * inputs.block_size * kv_token
    q_kv = (rank.num_heads + 2 * rank.num_kv_heads) * rank.head_dim
    per_token_values = 4 * shape.hidden_size + q_kv + 2 * rank.intermediate_size
    activations = inputs.max_num_batched_tokens * per_token_values * dtype_bytes(inputs.dtype)
    # The sampler's reserve comes after the forward's intermediates are freed: the peak is the larger.
    rows = min(inputs.max_num_seqs, inputs.max_num_batched_tokens)
    sampler = sampler_reserve(rows, shape.vocab_size)  # gathered: every rank holds the full logits
    return ModelMemory(
        num_parameters=count_parameters(shape).total,
        weights_bytes=weights_bytes(count_parameters(rank), inputs),
        kv_bytes_per_token=kv_token,
        kv_bytes_per_request=per_request,
        kv_needed_bytes=per_request * inputs.max_num_seqs,
        activation_bytes=max(activations, sampler),
        runtime_bytes=_RUNTIME_EAGER_BYTES if inputs.enforce_eager else _RUNTIME_BYTES,
    )


@dataclass(frozen=True)
class GPUFit:
    """The plan on one GPU model."""

    gpu: str
    """Catalog name."""
    memory_bytes: int
    """Device total."""
    safety_margin_bytes: int
    """total × (1 − gpu_memory_utilization)."""
    kv_budget_bytes: int
    """What remains for the KV cache (negative: the weights and overhead alone do not fit)."""
    kv_headroom_bytes: int
    """kv_budget − kv_needed (negative: short by that much)."""
    max_concurrency: int
    """Requests at the target context whose KV fits."""
    fits: bool
    """kv_budget ≥ kv_needed."""
    num_gpus: int
    """GPUs per replica (tensor parallel size)."""
    price_per_hour: float | None
    """USD per hour for the replica (all its GPUs), if a price was given."""


def fit_on(gpu: GPU, memory: ModelMemory, inputs: PlanInputs) -> GPUFit:
    usable = int(gpu.memory_bytes * inputs.gpu_memory_utilization)
    budget = usable - memory.weights_bytes - memory.activation_bytes - memory.runtime_bytes
    max_concurrency = max(0, budget) // memory.kv_bytes_per_request
    price = None if gpu.price_per_hour is None else gpu.price_per_hour * inputs.tensor_parallel_size
    return GPUFit(
        gpu=gpu.name, memory_bytes=gpu.memory_bytes, safety_margin_bytes=gpu.memory_bytes - usable,
        kv_budget_bytes=budget, kv_headroom_bytes=budget - memory.kv_needed_bytes,
        max_concurrency=max_concurrency, fits=budget >= memory.kv_needed_bytes,
        num_gpus=inputs.tensor_parallel_size, price_per_hour=price,
    )


@dataclass(frozen=True)
class KVCapacityPlan:
    """conveyor serve's KV sizing for a given byte budget (matches its start-up log)."""

    kv_cache_memory_bytes: int
    """The budget (--kv-cache-memory)."""
    block_size: int
    """Tokens per block."""
    bytes_per_block: int
    """2 × layers × block_size × kv_heads × head_dim × dtype bytes."""
    num_blocks: int
    """floor(budget / bytes_per_block)."""
    num_tokens: int
    """num_blocks × block_size."""
    max_model_len: int
    """Request length for the concurrency figure."""
    max_concurrency: float
    """num_blocks / ceil(max_model_len / block_size)."""


def kv_capacity(shape: ModelShape, kv_cache_memory_bytes: int, block_size: int,
                dtype: str = "float32", max_model_len: int = 2048) -> KVCapacityPlan:
    if kv_cache_memory_bytes < 1 or block_size < 1 or max_model_len < 1:
        raise PlanError("--kv-cache-memory, --block-size and --max-model-len must be >= 1")
    per_block = kv_bytes_per_token(shape, dtype_bytes(dtype)) * block_size
    num_blocks = kv_cache_memory_bytes // per_block
    return KVCapacityPlan(
        kv_cache_memory_bytes=kv_cache_memory_bytes, block_size=block_size, bytes_per_block=per_block,
        num_blocks=num_blocks, num_tokens=num_blocks * block_size, max_model_len=max_model_len,
        max_concurrency=num_blocks / math.ceil(max_model_len / block_size),
    )
