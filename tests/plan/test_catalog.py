"""The GPU catalog is one table (ftlaunch.plan.catalog.CARDS) that planning and the estimate both read:
every card has every field, and each reader sees the row's own figures."""

from __future__ import annotations

import pytest

from ftlaunch.estimate.throughput import peak_tflops
from ftlaunch.plan.catalog import CARDS, Card
from ftlaunch.plan.hardware import CATALOG, NO_P2P, catalog_hardware

OPTIONAL = {"note"}  # said only where a figure is not the vendor's


def field_problems(card: Card) -> list[str]:
    """What a catalog row lacks or holds wrong, one line per field."""
    out = [f"{name} is missing" for name in Card._fields if name not in OPTIONAL and getattr(card, name) is None]
    if not card.nvml_names or not all(isinstance(n, str) and n.strip() for n in card.nvml_names):
        out.append(f"nvml_names must name the card as NVML does, got {card.nvml_names!r}")
    if not (isinstance(card.memory_mib, int) and card.memory_mib > 0):
        out.append(f"memory_mib must be a whole number > 0, got {card.memory_mib!r}")
    cc = card.compute_capability
    if not (isinstance(cc, tuple) and len(cc) == 2 and all(isinstance(x, int) for x in cc)):
        out.append(f"compute_capability must be (major, minor), got {cc!r}")
    if not isinstance(card.p2p, bool):
        out.append(f"p2p must be True or False, got {card.p2p!r}")
    for name in ("tflops_16bit", "tflops_fp32"):
        value = getattr(card, name)
        if not (isinstance(value, float) and value > 0):
            out.append(f"{name} must be a number > 0, got {value!r}")
    return out


def test_every_card_has_every_field():
    assert len(CARDS) >= 16
    assert {key: field_problems(card) for key, card in CARDS.items() if field_problems(card)} == {}
    assert [key for key, card in CARDS.items() if card.key != key] == []


def test_the_check_names_a_missing_field():
    bad = Card("X", (), 0, (8,), None, 0.0, 1)  # type: ignore[arg-type]
    named = {line.split()[0] for line in field_problems(bad)}
    assert named == {"nvml_names", "memory_mib", "compute_capability", "p2p", "tflops_16bit", "tflops_fp32"}


@pytest.mark.parametrize("key", list(CARDS))
def test_planning_and_the_estimate_read_the_same_row(key):
    card = CARDS[key]
    assert CATALOG[key] == (card.nvml_name, card.memory_mib, card.compute_capability)
    assert (key in NO_P2P) is (not card.p2p)
    hw = catalog_hardware(f"{key}x2")
    assert {(g.name, g.total_mib, g.compute_capability) for g in hw.gpus} == {
        (card.nvml_name, card.memory_mib, card.compute_capability)
    }
    assert bool(hw.p2p_blocked) is (not card.p2p)
    for name in (key, *card.nvml_names):
        assert (peak_tflops(name, "bf16"), peak_tflops(name, "fp32")) == (card.tflops_16bit, card.tflops_fp32)
