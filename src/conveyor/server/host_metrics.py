"""What /metrics says about the machine and the model, beside the engine's statistics: the GPUs through
NVML (read when scraped), and the model's identity with its file digests (computed once, off the event
loop, in a background thread).

- `conveyor:gpu_memory_used_bytes` (memory in use on all visible GPUs, every process's, summed) and
  `conveyor:gpu_utilization_perc` (NVML's utilisation averaged over them, 1 = 100 %: the share of the
  last sample period a kernel ran, as NVML defines it) exist only where pynvml is installed and sees a
  GPU; `conveyor:gpu_info{name,count,memory_total_bytes}` comes from NVML, else from the engine's device
  ("cpu", count 0; or the CUDA name torch reports, count 1; memory "unknown").
- `conveyor:model_info{model_path,dtype,revision,quantization,config_sha256,weights_sha256,
  tokenizer_sha256}` appears once the digests are done (a GGUF of 100 MB takes well under a second; a
  checkpoint of many GB takes seconds, during which a client sees no model_info and hashes the files
  itself when it can). The digests are conveyor/file_digest.py's, the benchmark's own definition.
"""

from __future__ import annotations

import importlib
import logging
import pathlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from conveyor.engine.types import EngineInfo
from conveyor.file_digest import ModelDigests, model_digests

logger = logging.getLogger(__name__)
MODEL_INFO_LABELS = ("model_name", "model_path", "dtype", "revision", "quantization", "config_sha256",
                     "weights_sha256", "tokenizer_sha256")


@dataclass(frozen=True)
class GpuReading:
    """The visible GPUs at one moment, from NVML."""

    used_bytes: float
    """Memory in use, summed over the GPUs (every process's)."""
    utilization: float
    """Utilisation averaged over the GPUs, in [0, 1]."""
    names: tuple[str, ...]
    """Each GPU's name."""
    total_bytes: float = 0.0
    """Memory of the GPUs, summed."""


class Nvml:
    """pynvml, initialised on first use; `read()` is None where pynvml or a GPU is missing."""

    def __init__(self) -> None:
        self._module: Any = None
        self._tried = False

    def read(self) -> GpuReading | None:
        nvml = self._load()
        if nvml is None:
            return None
        try:
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            if not handles:
                return None
            memory = [nvml.nvmlDeviceGetMemoryInfo(h) for h in handles]
            util = sum(float(nvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in handles) / (100.0 * len(handles))
            return GpuReading(used_bytes=sum(float(m.used) for m in memory), utilization=util,
                              names=tuple(str(nvml.nvmlDeviceGetName(h)) for h in handles),
                              total_bytes=sum(float(m.total) for m in memory))
        except Exception as error:  # noqa: BLE001 - a failing NVML read means "not measured", never a 500
            logger.debug("NVML read failed: %s", error)
            return None

    def _load(self) -> Any:
        if not self._tried:
            self._tried = True
            try:
                module: Any = importlib.import_module("pynvml")  # optional dependency
                module.nvmlInit()
                self._module = module
            except Exception:  # noqa: BLE001 - no pynvml, no driver or no GPU: NVML is simply absent
                self._module = None
        return self._module


class GpuCollector(Collector):
    """conveyor:gpu_* read at scrape time (so every front end renders the same, current values)."""

    def __init__(self, info: EngineInfo, nvml: Nvml) -> None:
        self._model_name, self._device_name, self._nvml = info.model_name, info.device_name, nvml

    def collect(self) -> Iterator[GaugeMetricFamily]:
        reading = self._nvml.read()
        gpu_info = GaugeMetricFamily("conveyor:gpu_info", "The GPUs the server sees (value is always 1).",
                                     labels=["model_name", "name", "count", "memory_total_bytes"])
        if reading is not None:
            names = ", ".join(sorted(set(reading.names)))
            gpu_info.add_metric([self._model_name, names, str(len(reading.names)), str(int(reading.total_bytes))], 1)
        elif self._device_name is not None:
            count = "0" if self._device_name == "cpu" else "1"
            gpu_info.add_metric([self._model_name, self._device_name, count, "unknown"], 1)
        yield gpu_info
        if reading is None:
            return
        yield GaugeMetricFamily("conveyor:gpu_memory_used_bytes", "GPU memory in use (NVML, all processes, "
                                "summed over the visible GPUs).", value=reading.used_bytes)
        yield GaugeMetricFamily("conveyor:gpu_utilization_perc", "GPU utilisation (NVML, averaged over the "
                                "visible GPUs). 1 means 100 percent.", value=reading.utilization)


def _label(value: str | None) -> str:
    return "unknown" if value in (None, "", "none") else str(value)


def model_info_labels(info: EngineInfo, digests: ModelDigests) -> dict[str, str]:
    """The labels of conveyor:model_info ("unknown" where the engine did not say)."""
    flags = info.config
    return {"model_name": info.model_name, "model_path": _label(info.model_path),
            "dtype": _label(info.dtype or flags.get("dtype")), "revision": _label(flags.get("revision")), "quantization": _label(flags.get("quantization")),
            "config_sha256": _label(digests.config_sha256), "weights_sha256": _label(digests.weights_sha256),
            "tokenizer_sha256": _label(digests.tokenizer_sha256)}


class ModelInfoPublisher:
    """Hashes the model's files in a daemon thread, then sets conveyor:model_info."""

    def __init__(self, registry: CollectorRegistry, info: EngineInfo) -> None:
        self._gauge = Gauge("conveyor:model_info", "The served model and its files' SHA-256 (value is always 1).",
                            MODEL_INFO_LABELS, registry=registry, multiprocess_mode="mostrecent")
        self._info = info
        self.done = threading.Event()
        """Set once the series exists (tests wait on it)."""

    def start(self) -> None:
        threading.Thread(target=self._publish, name="conveyor-model-digests", daemon=True).start()

    def _publish(self) -> None:
        info, tokenizer = self._info, self._info.config.get("tokenizer")
        try:
            digests = model_digests(pathlib.Path(info.model_path) if info.model_path else None,
                                    pathlib.Path(tokenizer) if tokenizer not in (None, "none") else None)
        except OSError as error:
            logger.warning("model file digests for conveyor:model_info failed: %s", error)
            digests = ModelDigests()
        self._gauge.labels(**model_info_labels(info, digests)).set(1)
        self.done.set()
