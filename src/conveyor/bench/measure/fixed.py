"""The fixed things of a run: what must not change between runs that are compared.

The guide: keep the model revision, the tokenizer, the GPU type, the engine version and the trace fixed
between runs. Each run records them in summary.json `fixed` (docs/decision.md lists every source):
server name and version (`GET /version`, the metric families), model path, a SHA-256 of the model's
config, of its weights file(s) and of its tokenizer (the server's `conveyor:model_info` labels, else
the files themselves when the server runs on this host and the path is local), dtype, GPU name and
count (`conveyor:gpu_info`, else NVML on this host, else `device="cpu"` from the server's flags),
every flag the server reports (`conveyor:config_info` / `vllm:cache_config_info`), and the trace's
SHA-256. Anything not reported is recorded as null (unknown), never guessed. `differences` finds the
keys on which runs disagree, except those a study varies on purpose.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

from conveyor.bench.jsonvalue import JSON, Fields
from conveyor.bench.measure.prom_text import Snapshot
from conveyor.bench.measure.server_metrics import NvmlReading
from conveyor.file_digest import file_sha256, model_digests

FIXED_KEYS = ("server_name", "server_version", "model_path", "model_config_sha256", "weights_sha256",
              "tokenizer_sha256", "dtype", "gpu_name", "gpu_count", "trace_sha256")
"""What must agree between compared runs (server flags are recorded too, but differ by design)."""
MODEL_INFO = "conveyor:model_info"
GPU_INFO = "conveyor:gpu_info"
MODEL_INFO_HASH_LABELS = {"model_config_sha256": "config_sha256", "weights_sha256": "weights_sha256",
                          "tokenizer_sha256": "tokenizer_sha256"}
"""fixed key -> its label on conveyor:model_info."""
@dataclass(frozen=True)
class ServerView:
    """What the run learned about the server."""

    models: JSON
    """GET /v1/models (None: not answered)."""
    version: JSON
    """GET /version (None: not answered)."""
    snapshot: Snapshot | None
    """A /metrics scrape."""
    local: bool
    """The server runs on this host (its files and GPUs are ours to read)."""
    nvml: NvmlReading | None = None
    """NVML on this host (None: no pynvml or no GPU)."""


def _object(value: JSON, where: str) -> Fields:
    """A server answer read as an object; anything else (no answer, an error page) as an empty one."""
    return Fields.of(value if isinstance(value, dict) else None, where)


def _first_model(view: ServerView) -> Fields:
    """The first entry of /v1/models' `data` (the served model), empty when there is none."""
    data = _object(view.models, "/v1/models").raw("data")
    return _object(data[0] if isinstance(data, list) and data else None, "/v1/models data[0]")


def _known(value: str | None) -> str | None:
    return None if value in (None, "", "none", "None", "unknown") else value


def _server_name(view: ServerView) -> str | None:
    families = set(view.snapshot.by_name) if view.snapshot is not None else set()
    if any(name.startswith("conveyor:") for name in families):
        return "conveyor"
    owner = _first_model(view).opt_text("owned_by")
    if _known(owner):
        return owner
    return "vllm" if any(name.startswith("vllm:") for name in families) else None


def _model_path(view: ServerView, info: dict[str, str], flags: dict[str, str]) -> str | None:
    if _known(info.get("model_path")):
        return info["model_path"]
    if _known(flags.get("model")):
        return flags["model"]
    root = _first_model(view).opt_text("root")
    return root if root and ("/" in root or root.endswith(".gguf")) else None


def _local_hashes(model_path: str | None, tokenizer_flag: str | None) -> dict[str, str | None]:
    """config / weights / tokenizer digests from local files (a GGUF holds all three), as the server's
    conveyor:model_info computes them (conveyor/file_digest.py)."""
    digests = model_digests(pathlib.Path(model_path) if model_path else None,
                            pathlib.Path(tokenizer_flag) if tokenizer_flag else None)
    return {"model_config_sha256": digests.config_sha256, "weights_sha256": digests.weights_sha256,
            "tokenizer_sha256": digests.tokenizer_sha256}


def _gpu(view: ServerView, flags: dict[str, str]) -> tuple[str | None, int | None]:
    labels = view.snapshot.labels(GPU_INFO) if view.snapshot is not None else None
    if labels and _known(labels.get("name")):
        count = labels.get("count")
        return labels["name"], int(count) if count and count.isdigit() else None
    if view.local and view.nvml is not None:
        return ", ".join(sorted(set(view.nvml.names))), len(view.nvml.names)
    if flags.get("device") == "cpu":
        return "cpu", 0
    return None, None


def collect_fixed(view: ServerView, flags: dict[str, str], trace_path: str) -> dict[str, Any]:
    """summary.json `fixed`: every key of FIXED_KEYS (null when unknown) plus `server_flags`."""
    info = (view.snapshot.labels(MODEL_INFO) if view.snapshot is not None else None) or {}
    version = _object(view.version, "/version").opt_text("version")
    model_path = _model_path(view, info, flags)
    hashes = _local_hashes(model_path, _known(flags.get("tokenizer"))) if view.local else {}
    gpu_name, gpu_count = _gpu(view, flags)
    trace = pathlib.Path(trace_path)
    fixed: dict[str, Any] = {
        "server_name": _server_name(view), "server_version": version,
        "model_path": model_path, "dtype": _known(info.get("dtype")) or _known(flags.get("dtype")),
        "gpu_name": gpu_name, "gpu_count": gpu_count,
        "trace_sha256": file_sha256(trace) if trace.is_file() else None,
    }
    for key, label in MODEL_INFO_HASH_LABELS.items():
        fixed[key] = _known(info.get(label)) or hashes.get(key)
    fixed["server_flags"] = dict(flags)
    return fixed


def kv_cache_dtype(fixed: dict[str, Any]) -> str | None:
    """The run's KV cache element type from its server flags (conveyor's `kv_cache_dtype`, vLLM's
    `cache_dtype` label), with `auto` resolved to the model's dtype; None when the server did not say.
    Not a fixed thing: a study may vary it (e.g. bfloat16 against fp8, docs/performance.md)."""
    flags = fixed.get("server_flags")
    value = None
    if isinstance(flags, dict):
        value = _known(flags.get("kv_cache_dtype")) or _known(flags.get("cache_dtype"))
    if value == "auto":
        return _known(fixed.get("dtype")) or value
    return value


@dataclass(frozen=True)
class FixedDifference:
    """One fixed thing on which compared runs disagree."""

    key: str
    """A FIXED_KEYS entry."""
    values: dict[str, list[str]]
    """Each value seen -> the runs that recorded it."""

    def describe(self) -> str:
        shown = "; ".join(f"{value} ({', '.join(runs[:3])}{' ...' if len(runs) > 3 else ''})"
                          for value, runs in self.values.items())
        return f"{self.key} differs: {shown}"


@dataclass(frozen=True)
class FixedRecord:
    """One run's fixed things, as `differences` compares them."""

    run_label: str
    """The run."""
    config_name: str
    """Its configuration."""
    fixed: dict[str, Any]
    """summary.json `fixed` ({} for runs recorded before it existed)."""


def differences(records: list[FixedRecord], varied: dict[str, set[str]]) -> list[FixedDifference]:
    """Keys on which runs disagree (unknown values never disagree; keys a configuration varies on purpose,
    `varied[config]`, are left out for its runs)."""
    out = []
    for key in FIXED_KEYS:
        seen: dict[str, list[str]] = {}
        for record in records:
            value = record.fixed.get(key)
            if value is not None and key not in varied.get(record.config_name, set()):
                seen.setdefault(str(value), []).append(record.run_label)
        if len(seen) > 1:
            out.append(FixedDifference(key, seen))
    return out


def unknown_keys(records: list[FixedRecord]) -> list[str]:
    """Fixed things no run recorded (or some runs did not): they cannot be checked."""
    return [key for key in FIXED_KEYS if any(r.fixed.get(key) is None for r in records)]
