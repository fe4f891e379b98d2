"""Prices given per GPU (`--price H100=2.99,H200=3.79`) matched to the GPU names runs record."""

from __future__ import annotations

import pytest

from conveyor.bench.decide.cost import CostModel
from conveyor.bench.decide.gpu_prices import (
    PriceMatchError,
    key_matches,
    match_prices,
)
from conveyor.bench.measure.gpu_groups import short_gpu_names
from conveyor.bench.plan.gpu_catalog import (
    CatalogError,
    parse_price_items,
    parse_prices,
)

H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"


def test_price_items_split_on_commas_and_repeat() -> None:
    assert parse_price_items(["H100=2.99,H200=3.79", "cpu=0"]) == {"H100": 2.99, "H200": 3.79, "cpu": 0.0}
    assert parse_prices(["h100=2.5,H200=3"]) == {"H100": 2.5, "H200": 3.0}  # plan still maps onto its catalog
    with pytest.raises(CatalogError, match="--price"):
        parse_price_items(["H100"])
    with pytest.raises(CatalogError, match="--price"):
        parse_price_items(["H100=cheap"])


def test_a_short_name_matches_the_recorded_name_by_whole_words() -> None:
    assert key_matches("H100", H100) and key_matches("h100 80gb", H100) and key_matches(H100.lower(), H100)
    assert not key_matches("H10", H100) and not key_matches("H100", H200) and not key_matches("", H100)
    assert key_matches("A100-80GB", "NVIDIA A100-SXM4-80GB")


def test_each_gpu_gets_its_own_price() -> None:
    matched = match_prices({"H100": 2.99, "h200": 3.79}, [H100, H200])
    assert matched[H100].price_per_gpu_hour == 2.99 and matched[H200].price_per_gpu_hour == 3.79
    assert matched[H100].source == "--price H100"
    assert match_prices({"H100": 2.99}, [H100, H200]) == {H100: matched[H100]}  # H200: no price, none made up


def test_a_key_matching_no_gpu_several_or_twice_is_an_error_naming_the_flag() -> None:
    with pytest.raises(PriceMatchError, match=r"--price B200: matches no GPU .*NVIDIA H200"):
        match_prices({"B200": 5.0}, [H100, H200])
    with pytest.raises(PriceMatchError, match="--price NVIDIA: ambiguous"):
        match_prices({"NVIDIA": 3.0}, [H100, H200])
    with pytest.raises(PriceMatchError, match="--price H100 and --price 80GB both match"):
        match_prices({"H100": 3.0, "80GB": 2.0}, [H100, H200])


def test_short_names_and_no_price_says_for_which_gpu() -> None:
    assert short_gpu_names([H100, H200, "cpu"]) == {H100: "H100", H200: "H200", "cpu": "cpu"}
    assert short_gpu_names(["NVIDIA H100 PCIe", H100]) == {"NVIDIA H100 PCIe": "NVIDIA H100 PCIe", H100: H100}
    assert CostModel(gpu="H100").describe_price() == "no price given for H100"
    assert CostModel().describe_price() == "no price given"


def test_a_key_naming_one_gpu_exactly_prices_it_alone() -> None:
    # a simulated study scaled to the H200 records "H200" beside a measured "NVIDIA H200": each gets its own key
    matched = match_prices({"H200": 4.0, "NVIDIA H200": 3.5}, ["H200", "NVIDIA H200"])
    assert matched["H200"].price_per_gpu_hour == 4.0 and matched["NVIDIA H200"].price_per_gpu_hour == 3.5
    with pytest.raises(PriceMatchError, match="--price H200: ambiguous"):  # two GPUs hold the word, none is it
        match_prices({"H200": 4.0}, ["NVIDIA H200", "NVIDIA H200 NVL"])
