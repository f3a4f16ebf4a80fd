"""The formulas held to the simulator's figures (tests/data/memory_calibration.json, written by
scripts/calibrate_memory.py at full depth). Pure: the stored figures are read, nothing is simulated.

Goal (issue 12): every row within +-5 %, never more than 2 % under (an under-prediction is an OOM).
Rows known to miss it are listed in KNOWN_OFF with the reason, and are held to that documented
bound instead, so a change that makes them worse still fails.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from ftlaunch.plan.memory.peak import estimate
from ftlaunch.plan.memory.setup import TrainSetup
from ftlaunch.plan.modelspec import spec_from_config

DATA = Path(__file__).resolve().parent.parent / "data" / "memory_calibration.json"
ROWS = [r for r in json.loads(DATA.read_text())["rows"] if r.get("simulated_gib")]
OVER, UNDER = 0.05, -0.02

# key -> (lowest error allowed, highest error allowed, why the goal is not met)
KNOWN_OFF: dict[str, tuple[float, float, str]] = {}


def _error(row: dict) -> float:
    formula = estimate(spec_from_config(row["model_config"]), TrainSetup(**row["setup"])).tensors_gib
    return formula / row["simulated_gib"] - 1


def test_there_are_at_least_30_simulated_rows() -> None:
    assert len(ROWS) >= 30


@pytest.mark.parametrize("row", ROWS, ids=[r["key"] for r in ROWS])
def test_formula_within_goal_of_simulated_peak(row: dict) -> None:
    err = _error(row)
    low, high, why = KNOWN_OFF.get(row["key"], (UNDER, OVER, ""))
    assert low <= err <= high, f"{row['key']}: formula {err:+.1%} vs simulated {row['simulated_gib']:.2f} GiB {why}"


def test_median_error_is_small() -> None:
    assert abs(statistics.median(_error(r) for r in ROWS)) <= 0.03
