"""GPU catalog for the memory plan: the rental options the guide lists, with the memory each reports.

Memory is the total the driver reports (nvidia-smi "MiB" × 2^20; for the H200, the total CUDA reports,
measured here), because that is what an engine budgets from; the marketed figure is kept beside it.
Memory bandwidth and dense bf16 tensor throughput are the datasheets' peaks, for scaling a calibrated
step-time model from one GPU to another (`conveyor simulate --target-gpu`): only their ratios are used,
and None where no datasheet figure is recorded here.
Prices are never built in:
they vary by provider, region and commitment, so the user supplies them (`--price H100=2.5` or a file).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, replace

from conveyor.bench.table_file import read_table_file

_MIB = 1 << 20


class CatalogError(ValueError):
    """An unknown GPU name or malformed price; names the flag or file."""


@dataclass(frozen=True)
class GPU:
    """One GPU model."""

    name: str
    """Short name used on the command line (case-insensitive), e.g. H100."""
    description: str
    """Full name and memory type."""
    memory_bytes: int
    """Total device memory as the driver reports it."""
    marketed_memory_gb: float
    """The headline figure (decimal GB as sold)."""
    price_per_hour: float | None = None
    """User-supplied rental price, USD per GPU-hour (None: unknown)."""
    memory_bandwidth_bytes_per_s: float | None = None
    """Peak device-memory bandwidth, bytes/s, as the datasheet gives it (None: not recorded)."""
    bf16_dense_flops: float | None = None
    """Peak dense (no sparsity) bf16 tensor-core FLOP/s, as the datasheet gives it (None: not recorded)."""


CATALOG: tuple[GPU, ...] = (
    # "NVIDIA A100 Tensor Core GPU" datasheet, A100 80GB SXM: 2,039 GB/s; BF16 tensor 312 TFLOPS (624 sparse).
    GPU("A100-80GB", "NVIDIA A100 80GB SXM (HBM2e)", 81920 * _MIB, 80.0,
        memory_bandwidth_bytes_per_s=2.039e12, bf16_dense_flops=312e12),
    # "NVIDIA H100 Tensor Core GPU" datasheet, H100 SXM: 3.35 TB/s; BF16 tensor 1,979 TFLOPS with sparsity,
    # so 989 dense.
    GPU("H100", "NVIDIA H100 80GB SXM (HBM3)", 81559 * _MIB, 80.0,
        memory_bandwidth_bytes_per_s=3.35e12, bf16_dense_flops=989e12),
    # Measured here: CUDA reports 150109880320 bytes total on an H200 (nvidia-smi: 143771 MiB, 0.4% more).
    # "NVIDIA H200 Tensor Core GPU" datasheet, H200 SXM: 4.8 TB/s; BF16 tensor 1,979 TFLOPS with sparsity
    # (989 dense): the H100's compute with 1.43x its bandwidth.
    GPU("H200", "NVIDIA H200 141GB SXM (HBM3e)", 150_109_880_320, 141.0,
        memory_bandwidth_bytes_per_s=4.8e12, bf16_dense_flops=989e12),
    # HGX/DGX B200 ship 180 GB per GPU (the first announcement said 192 GB); the driver reports 183359 MiB.
    GPU("B200", "NVIDIA B200 180GB SXM (HBM3e)", 183359 * _MIB, 180.0),
    # B300 (Blackwell Ultra): 288 GB HBM3e marketed; the reported total is not confirmed here.
    GPU("B300", "NVIDIA B300 288GB SXM (HBM3e)", 288 * 10**9, 288.0),
    GPU("RTX5090", "NVIDIA GeForce RTX 5090 32GB (GDDR7)", 32607 * _MIB, 32.0),
)

_ALIASES = {"A100": "A100-80GB", "A100-80G": "A100-80GB", "H100-SXM": "H100", "RTX-5090": "RTX5090",
            "5090": "RTX5090"}


def find_gpu(name: str) -> GPU:
    """The catalog entry for `name` (case-insensitive, a few aliases)."""
    wanted = _ALIASES.get(name.upper(), name.upper())
    for gpu in CATALOG:
        if gpu.name.upper() == wanted.upper():
            return gpu
    known = ", ".join(g.name for g in CATALOG)
    raise CatalogError(f"unknown GPU {name!r}; the catalog has {known}")


def parse_prices(items: list[str]) -> dict[str, float]:
    """`H100=2.49` items (or one path to a JSON/TOML {gpu: price} file) -> {catalog name: USD/hour}."""
    return {find_gpu(name).name: price for name, price in parse_price_items(items).items()}


def parse_price_items(items: list[str]) -> dict[str, float]:
    """`--price` values as given: `H100=2.49`, `H100=2.49,H200=3.5` or a JSON/TOML {gpu: price} file ->
    {name as written: USD/hour}. The names are not looked up: `conveyor plan` maps them onto the catalog,
    `conveyor report` onto the GPU names its runs recorded."""
    prices: dict[str, float] = {}
    for item in items:
        path = pathlib.Path(item)
        if "=" not in item and path.is_file():
            prices.update(_prices_from_file(path))
            continue
        for part in item.split(","):
            name, sep, value = part.partition("=")
            if not sep or not name.strip():
                raise CatalogError(f"--price: expected GPU=USD_PER_HOUR[,GPU=USD_PER_HOUR] or a file, got {item!r}")
            prices[name.strip()] = _price(value.strip(), "--price")
    return prices


def _price(value: object, origin: str) -> float:
    try:
        price = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise CatalogError(f"{origin}: price must be a number of USD per GPU-hour (got {value!r})") from None
    if price < 0:
        raise CatalogError(f"{origin}: price must be >= 0 (got {price})")
    return price


def _prices_from_file(path: pathlib.Path) -> dict[str, float]:
    data = read_table_file(path)
    if not isinstance(data, dict):
        raise CatalogError(f"{path}: expected an object {{GPU: USD_PER_HOUR}}")
    return {str(k): _price(v, str(path)) for k, v in data.items()}


def priced_catalog(prices: dict[str, float], names: list[str] | None = None) -> list[GPU]:
    """The catalog (or the `names` subset, in that order) with user prices attached."""
    gpus = [find_gpu(n) for n in names] if names else list(CATALOG)
    return [replace(g, price_per_hour=prices.get(g.name)) for g in gpus]
