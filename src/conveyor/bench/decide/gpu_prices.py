"""User prices matched to the GPUs the runs recorded (summary.json `fixed.gpu_name`).

The model: the user names a GPU the short way (`--price H100=2.99`), the runs record what the driver
says ("NVIDIA H100 80GB HBM3"). A price key matches a GPU name when every word of the key (letters and
digits, case-insensitive) is a word of the name, so "H100" and "h100 80gb" match it and "H10" does not.
No price is built in: a GPU no key matches has none, and the decision ranks by capacity per GPU. A key
that matches no GPU, or several, and a GPU two keys match, are errors that name the flag: a price that
silently lands on the wrong GPU (or on none) would decide the comparison.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from conveyor.bench.decide.cost import CostModel
from conveyor.bench.measure.gpu_groups import GpuConfigs

PRICE_FLAG = "--price"


class PriceMatchError(ValueError):
    """A --price key that matches no GPU of the runs, or several, or a GPU that two keys match."""


@dataclass(frozen=True)
class GpuPrice:
    """One GPU's price, as the user gave it."""

    key: str
    """The name the user wrote (`H100` of `--price H100=2.99`)."""
    price_per_gpu_hour: float
    """USD per GPU-hour."""

    @property
    def source(self) -> str:
        """Where the price came from, as the cost's inputs show it."""
        return f"{PRICE_FLAG} {self.key}"


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def key_matches(key: str, gpu_name: str) -> bool:
    """Every word of `key` is a word of `gpu_name` ("H100" matches "NVIDIA H100 80GB HBM3")."""
    words = _words(key)
    return bool(words) and words <= _words(gpu_name)


def match_prices(prices: Mapping[str, float], gpu_names: Sequence[str]) -> dict[str, GpuPrice]:
    """gpu_name -> its price, for every GPU some key matches; raises PriceMatchError on a key that
    matches no GPU or several, and on a GPU that several keys match."""
    shown = ", ".join(gpu_names) or "none recorded"
    matched: dict[str, GpuPrice] = {}
    for key, price in prices.items():
        hits = [name for name in gpu_names if key_matches(key, name)]
        exact = [name for name in hits if _words(name) == _words(key)]
        hits = exact if len(exact) == 1 else hits  # "H200" is the GPU named "H200", not also "NVIDIA H200"
        if not hits:
            raise PriceMatchError(f"{PRICE_FLAG} {key}: matches no GPU the runs recorded (GPUs: {shown})")
        if len(hits) > 1:
            raise PriceMatchError(f"{PRICE_FLAG} {key}: ambiguous, matches {' and '.join(hits)}; "
                                  "name the GPU more exactly")
        if hits[0] in matched:
            raise PriceMatchError(f"{PRICE_FLAG} {matched[hits[0]].key} and {PRICE_FLAG} {key} both match "
                                  f"{hits[0]}; give one price per GPU")
        matched[hits[0]] = GpuPrice(key, price)
    return matched


def gpu_costs(gpus: GpuConfigs, prices: Mapping[str, GpuPrice], base: Mapping[str, CostModel],
              default: CostModel) -> dict[str, CostModel]:
    """label -> its cost model: the price given for its GPU (the flag names the hardware, so it wins over
    a study's one number), else its own (`base`: study.json) or the default, each saying for which GPU
    when the runs span several or prices were given per GPU."""
    out = {}
    for label, key in gpus.keys.items():
        model = base.get(label, default)
        gpu = gpus.short(key.gpu_name) if gpus.by_gpu or prices else None
        price = prices.get(key.gpu_name) if key.gpu_name is not None else None
        if price is None:
            out[label] = dataclasses.replace(model, gpu=gpu)
        else:
            out[label] = CostModel(price.price_per_gpu_hour, model.num_gpus, price.source, gpu)
    return out
