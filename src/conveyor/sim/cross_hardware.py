"""Cross-hardware what-if: a step-time model calibrated on one GPU, scaled to another (`--target-gpu`).

Each fitted term is scaled by what bounds it (first order, from the datasheets' peaks in the GPU catalog):
- per step (reading the weights once) and per context token (reading the KV cache): memory traffic, so
  times the bandwidth ratio source / target;
- per prefill and per decode token (the matmuls of each computed token): tensor-core compute, so times
  the dense bf16 FLOP ratio source / target;
- per sequence (sampling, input preparation, the host's per-request work) and the loop's time between
  steps (measured, not fitted): unchanged, they are not the GPU's.
The KV pool is the target's: the memory plan (bench/plan/memory.py, `conveyor plan`) of the model's
config.json on the target GPU at the simulated limits gives the KV budget, and blocks = budget / bytes
per block. Peaks are not what a kernel reaches, and ratios of peaks are the whole claim here: the
output is marked cross-hardware, and its error can only be known by measuring on the target.
"""

from __future__ import annotations

import argparse
import pathlib
from dataclasses import dataclass, replace

from conveyor.bench.measure.calibration import Calibration
from conveyor.bench.measure.summary import Simulated
from conveyor.bench.plan.gpu_catalog import CATALOG, GPU, find_gpu
from conveyor.bench.plan.memory import (
    DTYPE_BYTES,
    PlanInputs,
    fit_on,
    load_shape,
    model_memory,
)
from conveyor.core.step_time import CalibratedStepTime
from conveyor.sim.engine_setup import EngineSetup

_ALIASES = {"A100": "A100-80GB", "RTX 5090": "RTX5090"}
"""Spellings of a catalog GPU in a driver's name (the catalog's own names are tried first)."""


@dataclass(frozen=True)
class HardwareScale:
    """From the GPU the calibration was fitted on to the target."""

    source: GPU
    target: GPU

    def _ratio(self, source: float | None, target: float | None, what: str) -> float:
        if source is None or target is None or not (source > 0 and target > 0):
            missing = self.source.name if source is None else self.target.name
            raise ValueError(f"--target-gpu {self.target.name}: the GPU catalog has no {what} for {missing}; "
                             "cross-hardware scaling needs it for both GPUs")
        return source / target

    @property
    def bandwidth_ratio(self) -> float:
        """Time multiplier of memory-bound terms: source bandwidth / target bandwidth."""
        return self._ratio(self.source.memory_bandwidth_bytes_per_s, self.target.memory_bandwidth_bytes_per_s,
                           "memory bandwidth")

    @property
    def compute_ratio(self) -> float:
        """Time multiplier of compute-bound terms: source FLOP/s / target FLOP/s."""
        return self._ratio(self.source.bf16_dense_flops, self.target.bf16_dense_flops, "dense bf16 FLOP/s")


def scale_step_time(model: CalibratedStepTime, scale: HardwareScale) -> CalibratedStepTime:
    """The calibration's terms scaled to the target (module docstring)."""
    bandwidth, compute = scale.bandwidth_ratio, scale.compute_ratio
    return CalibratedStepTime(
        per_step_s=model.per_step_s * bandwidth, per_seq_s=model.per_seq_s,
        per_prefill_token_s=model.per_prefill_token_s * compute, per_decode_token_s=model.per_decode_token_s * compute,
        per_context_token_s=model.per_context_token_s * bandwidth,
        per_multi_row_step_s=model.per_multi_row_step_s * bandwidth, between_steps_s=model.between_steps_s,
        label=f"{model.label}, scaled {scale.source.name} -> {scale.target.name}")


def scaled_for_validation(model: object, calibrations: list[Calibration], target_gpu: str,
                          simulated: Simulated) -> tuple[CalibratedStepTime, Simulated]:
    """`--validate --target-gpu`: the calibration's terms scaled to the GPU the measured runs ran on.

    Each run keeps its own KV pool (its server's recorded block count), so the error measured is the
    scaled step time's alone; the plan's pool against the engine's is checked apart (`conveyor plan`)."""
    if not isinstance(model, CalibratedStepTime) or len(calibrations) != 1:
        raise ValueError("--target-gpu scales a calibration's terms: give --calibration (one entry)")
    scale = HardwareScale(catalog_gpu(calibrations[0].key.hardware), find_gpu(target_gpu))
    scaled = scale_step_time(model, scale)
    return scaled, replace(simulated, step_time=scaled.describe(),
                           target_gpu=f"{scale.target.name} (from {scale.source.name})")


def catalog_gpu(hardware: str) -> GPU:
    """The catalog GPU a calibration's hardware names ("NVIDIA H100 80GB HBM3 x1" -> H100)."""
    text = hardware.upper()
    names = sorted([*(g.name for g in CATALOG), *_ALIASES], key=len, reverse=True)
    for name in names:
        if name.upper() in text:
            return find_gpu(_ALIASES.get(name, name))
    raise ValueError(f"--target-gpu: the calibration's hardware {hardware!r} is not a GPU of the catalog "
                     f"({', '.join(g.name for g in CATALOG)}); scaling needs its bandwidth and FLOP/s")


def plan_num_blocks(config: pathlib.Path, setup: EngineSetup, target: GPU, calibration: Calibration,
                    gpu_memory_utilization: float) -> int:
    """KV blocks the memory plan gives the model on the target GPU at the simulated limits."""
    flags = dict(calibration.key.configuration)
    dtype = calibration.key.dtype if calibration.key.dtype in DTYPE_BYTES else "bfloat16"
    s = setup.scheduler
    kv_dtype = flags.get("kv_cache_dtype")  # the calibrated server's: an FP8 cache holds twice the blocks
    inputs = PlanInputs(dtype=dtype, kv_cache_dtype=kv_dtype if kv_dtype in DTYPE_BYTES else None,
                        max_num_seqs=s.max_num_seqs, context_len=s.max_model_len,
                        max_num_batched_tokens=s.max_num_batched_tokens, block_size=setup.cache.block_size,
                        gpu_memory_utilization=gpu_memory_utilization,
                        tensor_parallel_size=int(flags.get("tensor_parallel_size", "1")),
                        enforce_eager=flags.get("enforce_eager") == "true")
    memory = model_memory(load_shape(config), inputs)
    budget = fit_on(target, memory, inputs).kv_budget_bytes
    blocks = budget // (memory.kv_bytes_per_token * setup.cache.block_size)
    if blocks < 1:
        raise ValueError(f"--target-gpu {target.name}: the model's weights and overhead leave no KV cache")
    return blocks


def retarget(args: argparse.Namespace, model: object, setup: EngineSetup, simulated: Simulated,
             calibrations: list[Calibration]) -> tuple[CalibratedStepTime, EngineSetup, Simulated]:
    """The step model, pool and marker of a `--target-gpu` run (ValueError naming the flag)."""
    if not isinstance(model, CalibratedStepTime) or len(calibrations) != 1:
        raise ValueError("--target-gpu scales a calibration's terms: give --calibration (one entry)")
    scale = HardwareScale(catalog_gpu(calibrations[0].key.hardware), find_gpu(args.target_gpu))
    scaled = scale_step_time(model, scale)
    blocks = args.num_gpu_blocks_override
    if blocks is None:
        if args.model_config is None:
            raise ValueError("--target-gpu needs --model-config CONFIG.json (the memory plan sizes the target's KV "
                             "pool) or --num-gpu-blocks-override N")
        blocks = plan_num_blocks(pathlib.Path(args.model_config), setup, scale.target, calibrations[0],
                                 args.gpu_memory_utilization)
    return scaled, replace(setup, num_blocks=blocks), replace(
        simulated, step_time=scaled.describe(), target_gpu=f"{scale.target.name} (from {scale.source.name})")
