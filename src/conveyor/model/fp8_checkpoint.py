"""Hugging Face checkpoints already in FP8 (config.json `quantization_config.quant_method: "fp8"`), as
vLLM's `fp8` method loads a serialized checkpoint.

Such a checkpoint stores each quantized projection `X` as `X.weight` (float8_e4m3fn [N, K]) and a float32
per-tensor `X.weight_scale`, plus `X.input_scale` when `activation_scheme` is "static". Conveyor fuses
q/k/v and gate/up into one `Linear` with one scale, so the shards (each quantized with its own scale) are
copied in as raw FP8 bits and then re-expressed at the largest of their scales (`requantize_to_max_scale`,
vLLM's `requantize_with_max_scale`). Static input scales merge the same way (their max) and are applied
as given (`fp8_linear`'s `input_scale`); dynamic ones are computed per forward as for `--quantization fp8`.
Layers listed in `ignored_layers` / `modules_to_not_convert` stay 16-bit. Under tensor parallelism each
rank keeps its rows / columns of the stored FP8 tensors (model/parallel_layers.py) and merges its fused
shards with the scales of the whole checkpoint, so every rank holds the unsharded model's bits. Refused
with one line each: other quant methods, block-wise FP8 (`weight_block_size`), per-channel scales.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from conveyor.kernels.fp8_linear import FP8_WEIGHT_DTYPE
from conveyor.kernels.fp8_quant import quantize_fp8
from conveyor.model.layers import Linear
from conveyor.model.llama import LlamaForCausalLM
from conveyor.model.parallel_layers import ColumnParallelLinear

_WEIGHT_SCALE = ".weight_scale"
_INPUT_SCALE = ".input_scale"
_KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".q_scale", ".kv_scale", ".prob_scale")
"""Attention-cache scales some FP8 checkpoints carry: skipped (the FP8 KV cache uses vLLM's default 1.0)."""


class ActivationScheme(enum.Enum):
    """How a projection's input is scaled before its FP8 GEMM."""

    DYNAMIC = "dynamic"
    """max|x| / 448 per forward (as --quantization fp8)."""
    STATIC = "static"
    """The checkpoint's calibrated `input_scale`."""


@dataclass(frozen=True)
class Fp8CheckpointConfig:
    """What config.json's `quantization_config` says about an FP8 checkpoint."""

    activation_scheme: ActivationScheme
    """Dynamic or static (calibrated) activation scales."""
    ignored_layers: tuple[str, ...] = ()
    """HF module names (e.g. `model.layers.0.mlp.down_proj`) stored in 16 bits."""


def fp8_checkpoint_config(hf_config: Mapping[str, object]) -> Fp8CheckpointConfig | None:
    """The FP8 settings of a parsed config.json (None: not quantized); another quant method, block-wise
    FP8 or an unknown activation scheme raises a one-line ValueError."""
    quant = hf_config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, Mapping):
        raise ValueError(f"config.json: quantization_config must be an object (got {type(quant).__name__})")
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(f"the checkpoint is quantized with {method!r} (config.json quantization_config."
                         "quant_method); conveyor loads 16-bit, GGUF and 'fp8' (per-tensor) checkpoints only")
    if quant.get("weight_block_size") is not None:
        raise ValueError(f"block-wise FP8 checkpoints (weight_block_size {quant['weight_block_size']}) are not "
                         "supported; conveyor loads per-tensor FP8 scales only")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"config.json: FP8 activation_scheme must be 'dynamic' or 'static' (got {scheme!r})")
    ignored = [*_names(quant.get("ignored_layers")), *_names(quant.get("modules_to_not_convert"))]
    return Fp8CheckpointConfig(ActivationScheme(scheme), tuple(ignored))


def _names(value: object) -> list[str]:
    return [str(name) for name in value] if isinstance(value, list) else []


def fp8_storage(model: LlamaForCausalLM, config: Fp8CheckpointConfig) -> int:
    """Give every projection the checkpoint stores in FP8 an FP8 weight of its shape, in place (on the meta
    device, before materialization: the 16-bit copy is never allocated); returns how many."""
    kept = _ignored_modules(model, config.ignored_layers)
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name not in kept:
            module.weight = nn.Parameter(torch.empty_like(module.weight, dtype=FP8_WEIGHT_DTYPE), requires_grad=False)
            count += 1
    return count


def _ignored_modules(model: LlamaForCausalLM, hf_names: Iterable[str]) -> set[str]:
    """Conveyor module names of ignored HF layers (q_proj -> qkv_proj: a fused module with any ignored
    shard stays 16-bit; its FP8 shards are then refused by `_checked_weights`)."""
    modules = set()
    for hf_name in hf_names:
        target = model.checkpoint_target(f"{hf_name}.weight")
        if target is not None:
            modules.add(target[0].removesuffix(".weight"))
    return modules


@dataclass
class _Scales:
    """Per-shard scales read from the checkpoint: (conveyor module name, fused shard or None) -> [] float32."""

    weight: dict[tuple[str, int | None], torch.Tensor] = field(default_factory=dict)
    """`X.weight_scale` tensors."""
    input: dict[tuple[str, int | None], torch.Tensor] = field(default_factory=dict)
    """`X.input_scale` tensors (static activation scheme)."""


def load_fp8_checkpoint(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]],
                        config: Fp8CheckpointConfig) -> int:
    """Fill a model prepared by `fp8_storage` from an FP8 checkpoint's tensors, then merge each fused
    projection's shard scales; returns how many projections are FP8."""
    fp8_modules = {n for n, m in model.named_modules() if isinstance(m, Linear) and m.weight.dtype == FP8_WEIGHT_DTYPE}
    scales = _Scales()
    model.load_weights(_checked_weights(model, weights, fp8_modules, scales))
    for name in sorted(fp8_modules):
        module = model.get_submodule(name)
        assert isinstance(module, Linear)
        rows = _shard_rows(model, name, module, scales.weight)
        weight_scales = _shard_scales(scales.weight, name, rows, "weight_scale")
        module.weight_scale = requantize_to_max_scale(module.weight.data, weight_scales, list(rows.values()))
        if config.activation_scheme == ActivationScheme.STATIC:
            input_scales = _shard_scales(scales.input, name, rows, "input_scale")
            module.input_scale = torch.stack(input_scales).max().to(module.weight.device)
    return len(fp8_modules)


def _checked_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]], fp8_modules: set[str],
                     scales: _Scales) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's weights with the scales taken out into `scales`; a weight whose dtype does not
    match its module (FP8 into a 16-bit one, or the reverse) raises instead of being silently cast."""
    for hf_name, tensor in weights:
        if hf_name.endswith(_KV_SCALE_SUFFIXES):
            continue
        target = model.checkpoint_target(hf_name)
        if target is None:
            continue
        name, shard = target
        for suffix, table in ((_WEIGHT_SCALE, scales.weight), (_INPUT_SCALE, scales.input)):
            if name.endswith(suffix):
                if tensor.numel() != 1:
                    raise ValueError(f"{hf_name}: {tensor.numel()} scales; conveyor loads per-tensor FP8 scales only")
                table[(name.removesuffix(suffix), shard)] = tensor.reshape(()).float()
                break
        else:
            module_name = name.removesuffix(".weight")
            if name.endswith(".weight") and (module_name in fp8_modules) != (tensor.dtype == FP8_WEIGHT_DTYPE):
                expected = "float8_e4m3fn" if module_name in fp8_modules else "16-bit (an ignored layer)"
                raise ValueError(f"checkpoint tensor {hf_name!r} is {tensor.dtype}, expected {expected}")
            yield hf_name, tensor


def _shard_rows(model: LlamaForCausalLM, name: str, module: Linear,
                table: Mapping[tuple[str, int | None], torch.Tensor]) -> dict[int | None, int]:
    """Shard index -> its row count in `module`'s weight: {None: N} unfused, {0: q, 1: k, 2: v} fused (under
    tensor parallelism this rank's rows of each: every rank reads all scales, so all merge to one max)."""
    if (name, None) in table or not any(key[0] == name for key in table):
        return {None: module.out_features}
    if isinstance(module, ColumnParallelLinear):
        return {index: span.size for index, span in enumerate(module.spans)}
    return dict(enumerate(model.shard_rows(f"{name}.weight")))


def _shard_scales(table: Mapping[tuple[str, int | None], torch.Tensor], name: str, rows: Mapping[int | None, int],
                  kind: str) -> list[torch.Tensor]:
    missing = [shard for shard in rows if (name, shard) not in table]
    if missing:
        raise ValueError(f"the FP8 checkpoint lacks {kind} for {name} (shards {missing})")
    return [table[(name, shard)] for shard in rows]


@torch.no_grad()
def requantize_to_max_scale(weight: torch.Tensor, scales: Sequence[torch.Tensor], rows: Sequence[int]) -> torch.Tensor:
    """weight [N, K] fp8 holding consecutive row blocks `rows`, block i quantized with `scales[i]`:
    re-expresses every block at the largest scale, in place, and returns it ([] float32 on weight's device).

    A value q * s_i becomes e4m3(q * s_i / s_max) * s_max: exact where the ratio is a power of two and the
    result stays normal, otherwise rounded to nearest (at most half an e4m3 step: 2^-4 relative for normal
    values, s_max * 2^-10 absolute below 2^-6 * s_max). s_i <= s_max, so nothing saturates."""
    assert sum(rows) == weight.shape[0] and len(rows) == len(scales), f"rows {list(rows)} for {tuple(weight.shape)}"
    stacked = torch.stack([s.reshape(()).float() for s in scales]).to(weight.device)  # [shards]
    merged = stacked.max()
    start = 0
    for index, count in enumerate(rows):
        if bool(stacked[index] != merged):  # a host sync per shard: load time only
            block = weight[start:start + count]
            block.copy_(quantize_fp8(block.float() * stacked[index], merged))
        start += count
    return merged
