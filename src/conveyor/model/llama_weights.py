"""The Llama family's checkpoint side: Hugging Face tensor names mapped onto the fused parameters.

Weights arrive under HF names through `load_weights`, which packs q/k/v and gate/up into the fused
projections (`qkv_proj`, `gate_up_proj`); every loader (safetensors, GGUF, dummy) feeds it the same way,
tensor-parallel layers copy out their own shard (`load_full`) and quantized modules take whole blocks.
`LlamaCheckpoint` is the base of model/llama.py's `LlamaForCausalLM`, which holds `config`, `model` and
`lm_head`; kept apart because the mapping is one concern and the forward another.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from conveyor.model.parallel_layers import ShardedModule
from conveyor.model.quantized import BlockFormat, QuantizedLinear, QuantizedWeight
from conveyor.model.registry import ModelArchConfig

# HF projection name -> (fused parameter name, shard index within it).
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")



class LlamaCheckpoint(nn.Module):
    """HF names -> (fused) parameters of a Llama-layout model; see the module docstring."""

    config: ModelArchConfig
    lm_head: nn.Linear | None

    def block_format_plan(self, formats: dict[str, BlockFormat | None]) -> dict[str, BlockFormat]:
        """Module name -> layout, for each Linear / Embedding whose every checkpoint shard (HF names in
        `formats`) has the same block layout; a module with any float or mixed shard stays float."""
        by_module: dict[str, set[BlockFormat | None]] = {}
        for hf_name, block_format in formats.items():
            module_name = self._module_of(hf_name)
            if module_name is not None:
                by_module.setdefault(module_name, set()).add(block_format)
        return {
            name: block_format
            for name, found in by_module.items()
            for block_format in found
            if len(found) == 1 and block_format is not None
            and isinstance(self.get_submodule(name), (nn.Linear, nn.Embedding))
        }

    def block_weight_names(self, formats: dict[str, BlockFormat | None]) -> frozenset[str]:
        """The HF names a loader should hand over in blocks: those feeding a quantized module."""
        quantized = {name for name, m in self.named_modules() if isinstance(m, QuantizedLinear)}
        return frozenset(h for h in formats if self._module_of(h) in quantized)

    def _module_of(self, hf_name: str) -> str | None:
        target = self._target_of(hf_name)
        return target[0].removesuffix(".weight") if target and target[0].endswith(".weight") else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Copy HF-named tensors into the (fused) parameters or quantized modules; raises on unknown
        or missing ones."""
        params = dict(self.named_parameters())
        blocks = {f"{n}.weight": m for n, m in self.named_modules() if isinstance(m, QuantizedLinear)}
        loaded: set[tuple[str, int | None]] = set()
        for hf_name, tensor in weights:
            target = self._target_of(hf_name)
            if target is None:
                continue
            name, shard = target
            if name in blocks and isinstance(tensor, QuantizedWeight):
                self._load_blocks(blocks[name], name, shard, tensor)
            elif name in params and isinstance(tensor, torch.Tensor):
                self._copy_into(params[name], name, shard, tensor)
            else:
                raise ValueError(f"checkpoint tensor {hf_name!r} ({type(tensor).__name__}) does not fit "
                                 f"{name!r} in {type(self).__name__}")
            loaded.add((name, shard))
        missing = sorted({name for name, shard in self._expected_shards([*params, *blocks]) - loaded})
        if missing:
            raise ValueError(f"checkpoint lacks weights for {len(missing)} parameters, e.g. {missing[:4]}")

    def _load_blocks(self, module: QuantizedLinear, name: str, shard: int | None, weight: QuantizedWeight) -> None:
        sizes = [module.out_features] if shard is None else self._shard_sizes_of(name)
        index = 0 if shard is None else shard
        if weight.shape[0] != sizes[index]:
            raise ValueError(f"{name} (shard {shard}): expected {sizes[index]} rows, got {weight.shape[0]}")
        module.load_rows(sum(sizes[:index]), weight)

    def checkpoint_target(self, hf_name: str) -> tuple[str, int | None] | None:
        """(parameter name, fused shard or None) an HF tensor name loads into, or None when it is skipped
        (model/fp8_checkpoint.py maps scale tensors through it too: `q_proj.weight_scale` -> qkv_proj, 0)."""
        return self._target_of(hf_name)

    def shard_rows(self, name: str) -> list[int]:
        """Row counts of the shards fused in parameter `name` (a qkv_proj or gate_up_proj one)."""
        return self._shard_sizes_of(name)

    def _target_of(self, hf_name: str) -> tuple[str, int | None] | None:
        """(parameter name, fused shard or None) for an HF tensor name, or None to skip it."""
        if "rotary_emb.inv_freq" in hf_name:
            return None
        if hf_name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: some checkpoints still store the copy
        match = _LAYER_INDEX.match(hf_name)
        if match and int(match.group(1)) >= self.config.num_hidden_layers:
            return None  # truncated by num_hidden_layers_override
        for proj, (fused, shard) in _FUSED_SHARDS.items():
            if f".{proj}." in hf_name:
                return hf_name.replace(f".{proj}.", f".{fused}."), shard
        return hf_name, None

    def _expected_shards(self, names: Iterable[str]) -> set[tuple[str, int | None]]:
        expected: set[tuple[str, int | None]] = set()
        for name in names:
            if ".qkv_proj." in name:
                expected |= {(name, 0), (name, 1), (name, 2)}
            elif ".gate_up_proj." in name:
                expected |= {(name, 0), (name, 1)}
            else:
                expected.add((name, None))
        return expected

    def _copy_into(self, param: nn.Parameter, name: str, shard: int | None, tensor: torch.Tensor) -> None:
        owner_name, _, attr = name.rpartition(".")
        owner = self.get_submodule(owner_name)
        if isinstance(owner, ShardedModule):  # tensor parallel: the layer keeps its own rows / columns
            owner.load_full(attr, shard, tensor)
            return
        target = param.data
        if shard is not None:
            sizes = self._shard_sizes_of(name)
            start = sum(sizes[:shard])
            target = target.narrow(0, start, sizes[shard])
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{name} (shard {shard}): expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
        with torch.no_grad():
            target.copy_(tensor)

    def _shard_sizes_of(self, name: str) -> list[int]:
        if ".qkv_proj." in name:
            return self.model.layers[0].self_attn.shard_sizes()
        return [self.config.intermediate_size, self.config.intermediate_size]
