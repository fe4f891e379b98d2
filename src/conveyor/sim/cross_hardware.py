"""Cross-hardware what-if: a step-time model calibrated on one GPU, scaled to another (`--target-gpu`).

Each fitted term is scaled by what bounds it (first order, from the datasheets' peaks in the GPU catalog):
- per step (reading the weights once) and per context token (reading the KV cache): memory traffic, so
  times the bandwidth ratio source / target;
- per prefill and per decode token (the matmuls of each computed token): tensor-core compute, so times
  the dense bf16 FLOP ratio source / target;
- with the model's config.json (`--model-config`), only the part of a term that its work needs at the
  source's peak is scaled (the roofline's floor: the weights' bytes / peak bandwidth for the per-step
  term, KV bytes per context token / bandwidth, 2 x the layers' parameters / peak FLOP/s per token);
  what the fitted term holds above that floor is not the peak's (latency-bound small kernels, launches,
  synchronization, the fraction of peak a kernel reaches) and stays as measured. Without the config the
  whole term is scaled;
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
from collections.abc import Callable
from dataclasses import dataclass, replace

from conveyor.bench.measure.calibration import Calibration
from conveyor.bench.measure.summary import Simulated
from conveyor.bench.plan.gpu_catalog import CATALOG, GPU, find_gpu
from conveyor.bench.plan.memory import (
    DTYPE_BYTES,
    FP8_METHODS,
    PlanInputs,
    count_parameters,
    fit_on,
    load_shape,
    model_memory,
    shape_per_rank,
    weights_bytes,
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


@dataclass(frozen=True)
class ModelWork:
    """What one GPU of the model moves or computes, for each term's roofline floor on the source GPU."""

    step_bytes: float
    """The weights read once per step (an untied embedding table is not: only its rows are gathered)."""
    context_token_bytes: float
    """K and V of one attended context token, all layers."""
    token_flops: float
    """Per computed token: 2 x the layers' matmul parameters (the LM head runs on sampled rows only)."""


def _split(term: float, floor_s: float | None, ratio: float) -> float:
    """The term's floor (its work at the source's peak) times the ratio; what it holds above, as measured."""
    if floor_s is None:
        return term * ratio
    scaled = min(term, floor_s)
    return scaled * ratio + (term - scaled)


def scale_step_time(model: CalibratedStepTime, scale: HardwareScale, work: ModelWork | None = None) -> CalibratedStepTime:
    """The calibration's terms scaled to the target (module docstring); `work` splits them at their floors."""
    bandwidth, compute = scale.bandwidth_ratio, scale.compute_ratio
    source_bw, source_flops = scale.source.memory_bandwidth_bytes_per_s, scale.source.bf16_dense_flops
    assert source_bw is not None and source_flops is not None  # the ratios above refuse a GPU without them
    weights_s = work.step_bytes / source_bw if work else None
    kv_s = work.context_token_bytes / source_bw if work else None
    token_s = work.token_flops / source_flops if work else None
    return CalibratedStepTime(
        per_step_s=_split(model.per_step_s, weights_s, bandwidth), per_seq_s=model.per_seq_s,
        per_prefill_token_s=_split(model.per_prefill_token_s, token_s, compute),
        per_decode_token_s=_split(model.per_decode_token_s, token_s, compute),
        per_context_token_s=_split(model.per_context_token_s, kv_s, bandwidth),
        per_multi_row_step_s=model.per_multi_row_step_s * bandwidth, per_gemm_step_s=model.per_gemm_step_s * bandwidth,
        between_steps_s=model.between_steps_s,
        front_end_in_s=model.front_end_in_s, front_end_out_s=model.front_end_out_s,  # the host's, not the GPU's
        label=f"{model.label}, scaled {scale.source.name} -> {scale.target.name}"
              + (" above the roofline floors" if work else ""))


def scaled_for_validation(model: object, calibrations: list[Calibration], target_gpu: str,
                          simulated: Simulated, config: pathlib.Path | None = None) -> tuple[CalibratedStepTime, Simulated]:
    """`--validate --target-gpu`: the calibration's terms scaled to the GPU the measured runs ran on
    (split at their floors when `config`, the model's config.json, is given).

    Each run keeps its own KV pool (its server's recorded block count), so the error measured is the
    scaled step time's alone; the plan's pool against the engine's is checked apart (`conveyor plan`)."""
    if not isinstance(model, CalibratedStepTime) or len(calibrations) != 1:
        raise ValueError("--target-gpu scales a calibration's terms: give --calibration (one entry)")
    scale = HardwareScale(catalog_gpu(calibrations[0].key.hardware), find_gpu(target_gpu))
    work = model_work(config, calibrations[0]) if config is not None else None
    scaled = scale_step_time(model, scale, work)
    return scaled, replace(simulated, step_time=scaled.describe(), gpu_name=scale.target.name,
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


def _plan_inputs(calibration: Calibration, setup: EngineSetup | None = None,
                 gpu_memory_utilization: float = PlanInputs.gpu_memory_utilization) -> PlanInputs:
    """The memory plan's inputs for the calibrated server (at the simulated limits when `setup`)."""
    flags = dict(calibration.key.configuration)
    dtype = calibration.key.dtype if calibration.key.dtype in DTYPE_BYTES else "bfloat16"
    kv_dtype = flags.get("kv_cache_dtype")  # the calibrated server's: an FP8 cache holds twice the blocks
    inputs = PlanInputs(dtype=dtype, kv_cache_dtype=kv_dtype if kv_dtype in DTYPE_BYTES else None,
                        gpu_memory_utilization=gpu_memory_utilization,
                        tensor_parallel_size=int(flags.get("tensor_parallel_size", "1")),
                        enforce_eager=flags.get("enforce_eager") == "true")
    if setup is None:
        return inputs
    s = setup.scheduler
    return replace(inputs, max_num_seqs=s.max_num_seqs, context_len=s.max_model_len,
                   max_num_batched_tokens=s.max_num_batched_tokens, block_size=setup.cache.block_size)


def model_work(config: pathlib.Path, calibration: Calibration) -> ModelWork:
    """The roofline work of one GPU of the calibrated server's model (`ModelWork`)."""
    quantization = dict(calibration.key.configuration).get("quantization")  # fp8: one byte a projection weight
    inputs = replace(_plan_inputs(calibration), quantization=quantization if quantization in FP8_METHODS else None)
    shape = load_shape(config)
    params = count_parameters(shape_per_rank(shape, inputs.tensor_parallel_size))
    read = replace(params, embedding=0) if params.lm_head else params  # tied: the table is the LM head, read whole
    return ModelWork(step_bytes=weights_bytes(read, inputs),
                     context_token_bytes=model_memory(shape, inputs).kv_bytes_per_token,
                     token_flops=2 * (params.attention + params.mlp))


def plan_num_blocks(config: pathlib.Path, setup: EngineSetup, target: GPU, calibration: Calibration,
                    gpu_memory_utilization: float) -> int:
    """KV blocks the memory plan gives the model on the target GPU at the simulated limits."""
    inputs = _plan_inputs(calibration, setup, gpu_memory_utilization)
    memory = model_memory(load_shape(config), inputs)
    budget = fit_on(target, memory, inputs).kv_budget_bytes
    blocks = budget // (memory.kv_bytes_per_token * setup.cache.block_size)
    if blocks < 1:
        raise ValueError(f"--target-gpu {target.name}: the model's weights and overhead leave no KV cache")
    return blocks


PoolSize = Callable[[EngineSetup], int]
"""A configuration's KV pool on the target GPU, from its limits (the memory plan)."""


def retarget_study(args: argparse.Namespace, model: object, simulated: Simulated,
                   calibrations: list[Calibration]) -> tuple[CalibratedStepTime, Simulated, PoolSize | None]:
    """The scaled step model and marker of a `--target-gpu` simulation, and how each configuration's pool is
    sized: by the memory plan at its own limits, or None where --num-gpu-blocks-override fixes it (ValueError
    naming the flag)."""
    if not isinstance(model, CalibratedStepTime) or len(calibrations) != 1:
        raise ValueError("--target-gpu scales a calibration's terms: give --calibration (one entry)")
    scale = HardwareScale(catalog_gpu(calibrations[0].key.hardware), find_gpu(args.target_gpu))
    config = pathlib.Path(args.model_config) if args.model_config is not None else None
    scaled = scale_step_time(model, scale, model_work(config, calibrations[0]) if config else None)
    marked = replace(simulated, step_time=scaled.describe(), gpu_name=scale.target.name,
                     target_gpu=f"{scale.target.name} (from {scale.source.name})")
    if args.num_gpu_blocks_override is not None:
        return scaled, marked, None
    if config is None:
        raise ValueError("--target-gpu needs --model-config CONFIG.json (the memory plan sizes the target's KV "
                         "pool) or --num-gpu-blocks-override N")
    return scaled, marked, lambda setup: plan_num_blocks(config, setup, scale.target, calibrations[0],
                                                         args.gpu_memory_utilization)


def retarget(args: argparse.Namespace, model: object, setup: EngineSetup, simulated: Simulated,
             calibrations: list[Calibration]) -> tuple[CalibratedStepTime, EngineSetup, Simulated]:
    """The step model, pool and marker of a `--target-gpu` run (ValueError naming the flag)."""
    scaled, marked, pool = retarget_study(args, model, simulated, calibrations)
    return scaled, setup if pool is None else replace(setup, num_blocks=pool(setup)), marked
