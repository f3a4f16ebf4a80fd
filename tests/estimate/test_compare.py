"""Comparing machines: prices, rows and their order (pure)."""

from __future__ import annotations

import pytest

from ftlaunch.estimate import compare


def test_parse_prices_and_bad_items():
    assert compare.parse_prices(["A100-80GB=1.9", "H100=3.5"]) == {"A100-80GB": 1.9, "H100": 3.5}
    for bad in ("A100", "A100=", "=2", "A100=x", "A100=-1", "A100=nan"):
        with pytest.raises(ValueError, match="CARD=PRICE"):
            compare.parse_prices([bad])


def test_price_matches_catalog_names_and_gpu_names_longest_first():
    prices = {"A100": 1.0, "A100-80GB": 1.9, "H100": 3.5}
    assert compare.price_for("A100-80GBx4", "NVIDIA A100-SXM4-80GB", prices) == 1.9
    assert compare.price_for("A100-40GB", "NVIDIA A100-SXM4-40GB", prices) == 1.0
    assert compare.price_for("hw.json", "NVIDIA H100 80GB HBM3", prices) == 3.5
    assert compare.price_for("V100-32GB", "Tesla V100-SXM2-32GB", prices) is None


def plan(gpus: int, name: str = "NVIDIA A100-SXM4-80GB") -> dict:
    return {
        "hardware": {"gpus": [{"name": name}] * gpus},
        "precision": "bf16",
        "micro_batch": 4,
        "accumulation": 2,
        "changes": [{"key": "bf16", "old": None, "new": True, "reason": "x"}],
        "memory": {"verdict": "fits"},
    }


def estimate(wall: tuple[float, float], gpus: int) -> dict:
    return {
        "wall_hours": list(wall),
        "gpu_hours": [wall[0] * gpus, wall[1] * gpus],
        "train_seconds_central": 3600.0,
        "run_tokens": 7_200_000,
        "time_source": "peak-flops",
    }


def test_rows_cost_and_order():
    prices = {"A100-80GB": 2.0}
    one = compare.row_from_estimate("A100-80GB", plan(1), estimate((2.0, 4.0), 1), prices)
    four = compare.row_from_estimate("A100-80GBx4", plan(4), estimate((0.5, 1.0), 4), prices)
    refused = compare.row_from_refusal(
        "T4",
        "Tesla T4",
        1,
        "does not fit",
        [{"option": "ZeRO-3 offload", "fits": False}, {"option": "LoRA", "fits": True}],
    )
    assert one.cost == (4.0, 8.0) and four.cost == (4.0, 8.0)
    assert one.tokens_per_second == 2000.0  # run tokens / central training seconds
    assert four.notes and "linear" in four.notes[0] and not one.notes
    assert refused.alternative == {"option": "LoRA", "fits": True} and refused.wall_hours is None
    ordered = compare.order([refused, one, four])
    assert [r.machine for r in ordered] == ["A100-80GBx4", "A100-80GB", "T4"]
    d = four.to_dict()
    assert set(d) >= {"gpu", "count", "fits", "precision", "micro_batch", "accumulation", "changes"}
    assert set(d) >= {"tokens_per_second", "wall_hours", "gpu_hours", "cost"}
    assert d["count"] == 4 and d["gpu_hours"] == [2.0, 4.0]


def test_a_bad_price_is_a_usage_error_naming_the_option():
    from click.testing import CliRunner

    from ftlaunch.cli.main import main

    r = CliRunner().invoke(main, ["estimate", "cfg.yaml", "--gpu", "T4", "--gpu", "A10G", "--price", "A100"])
    assert r.exit_code == 2 and "--price" in r.output and "CARD=PRICE" in r.output
