"""Compare machines before renting: one row per machine from its plan (or refusal) and estimate.

Pure: the rows are built from data the shells produced (`make_plan`, `build_estimate`); prices are
matched to machines by card name. Rendering and I/O live in ftlaunch/cli/estimate.py.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ftlaunch.plan.memory.prediction import MemoryPrediction

# Data-parallel scaling is not modelled (no communication cost): stated with every comparison.
SCALING_NOTE = (
    "several GPUs: time assumes linear data-parallel scaling (no communication cost); expect real "
    "multi-GPU and multi-node runs to be slower by the all-reduce time"
)


def parse_prices(items: Sequence[str]) -> dict[str, float]:
    """`--price A100-80GB=1.9` (per GPU-hour) -> {"A100-80GB": 1.9}; a bad item raises ValueError."""
    out: dict[str, float] = {}
    for item in items:
        card, sep, value = item.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not sep or not card.strip() or not math.isfinite(price) or price < 0:
            raise ValueError(f"--price {item!r}: expected CARD=PRICE per GPU-hour, e.g. A100-80GB=1.9")
        out[card.strip()] = price
    return out


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def price_for(machine: str, gpu_name: str | None, prices: Mapping[str, float]) -> float | None:
    """The price whose card name matches this machine's catalog name or GPU name (longest match)."""
    keys = [_norm(re.sub(r"x\d+$", "", machine)), _norm(gpu_name or "")]  # "A100-80GBx4" -> the card
    best: tuple[int, float] | None = None
    for card, price in prices.items():
        c = _norm(card)
        if c and any(k and (k == c or k.startswith(c) or c in k) for k in keys):
            if best is None or len(c) > best[0]:
                best = (len(c), price)
    return None if best is None else best[1]


def unmatched_prices(prices: Mapping[str, float], machines: Sequence[tuple[str, str | None]]) -> list[str]:
    """The cards of ``prices`` that match none of ``machines`` ((asked-for name, GPU name) pairs) by
    ``price_for``'s rule: a --price that would price nothing, said rather than ignored."""
    return [
        card
        for card in prices
        if not any(price_for(machine, gpu, {card: prices[card]}) is not None for machine, gpu in machines)
    ]


def check_prices(prices: Mapping[str, float], machines: Sequence[tuple[str, str | None]]) -> None:
    """Raise a usage error (exit 2) naming each --price card no compared machine has, and the valid ones."""
    from ftlaunch.errors import ExitCode, FtlaunchError

    if unknown := unmatched_prices(prices, machines):
        valid = sorted({re.sub(r"x\d+$", "", m) for m, _ in machines if m} | {g for _, g in machines if g})
        raise FtlaunchError(
            f"--price {', '.join(unknown)}: no compared machine has that card",
            hint=f"price one of: {', '.join(valid)} (e.g. --price {valid[0] if valid else 'A100-80GB'}=1.9)",
            exit_code=ExitCode.USAGE,
        )


@dataclass(frozen=True)
class MachineRow:
    """One machine of a comparison."""

    machine: str  # what the user asked for: "A100-80GBx4" or a hardware file
    gpu: str | None
    count: int
    fits: bool
    verdict: str | None = None  # the memory model's verdict (fits / tight / does not fit)
    precision: str | None = None
    micro_batch: int | None = None
    accumulation: int | None = None
    changes: tuple[Mapping[str, Any], ...] = ()
    tokens_per_second: float | None = None
    wall_hours: tuple[float, float] | None = None
    gpu_hours: tuple[float, float] | None = None
    cost: tuple[float, float] | None = None
    price_per_gpu_hour: float | None = None
    time_source: str | None = None
    alternative: Mapping[str, Any] | None = None  # the best option that would fit, when nothing does
    message: str = ""
    notes: tuple[str, ...] = field(default=())

    @property
    def central_hours(self) -> float:
        """For ordering: the geometric middle of the range; machines without a time sort last."""
        if not self.fits or not self.wall_hours:
            return math.inf
        return math.sqrt(self.wall_hours[0] * self.wall_hours[1])

    def to_dict(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "gpu": self.gpu,
            "count": self.count,
            "fits": self.fits,
            "verdict": self.verdict,
            "precision": self.precision,
            "micro_batch": self.micro_batch,
            "accumulation": self.accumulation,
            "changes": [dict(c) for c in self.changes],
            "tokens_per_second": self.tokens_per_second,
            "wall_hours": list(self.wall_hours) if self.wall_hours else None,
            "gpu_hours": list(self.gpu_hours) if self.gpu_hours else None,
            "cost": list(self.cost) if self.cost else None,
            "price_per_gpu_hour": self.price_per_gpu_hour,
            "time_source": self.time_source,
            "alternative": dict(self.alternative) if self.alternative else None,
            "message": self.message,
            "notes": list(self.notes),
        }


def row_from_estimate(
    machine: str, plan: Mapping[str, Any], estimate: Mapping[str, Any], prices: Mapping[str, float]
) -> MachineRow:
    """A machine that fits: its plan (`Plan.to_dict()`) and its estimate (`Estimate.to_dict()`)."""
    gpus = plan["hardware"].get("gpus") or []
    gpu = gpus[0]["name"] if gpus else None
    wall = estimate.get("wall_hours")
    gh = estimate.get("gpu_hours")
    train_s = estimate.get("train_seconds_central")
    tokens = estimate.get("run_tokens")
    tps = estimate.get("tokens_per_second")  # measured by a probe
    if tps is None and train_s and tokens:
        tps = float(tokens) / float(train_s)  # the estimate's sustained rate (start-up and saves excluded)
    price = price_for(machine, gpu, prices)
    cost = (round(gh[0] * price, 2), round(gh[1] * price, 2)) if price is not None and gh else None
    mem = MemoryPrediction.from_dict(plan.get("memory"))
    return MachineRow(
        machine=machine,
        gpu=gpu,
        count=len(gpus),
        fits=True,
        verdict=mem.verdict.value if mem else "fits",
        precision=plan.get("precision"),
        micro_batch=plan.get("micro_batch"),
        accumulation=plan.get("accumulation"),
        changes=tuple(plan.get("changes") or ()),
        tokens_per_second=None if tps is None else round(float(tps), 1),
        wall_hours=tuple(wall) if wall else None,
        gpu_hours=tuple(gh) if gh else None,
        cost=cost,
        price_per_gpu_hour=price,
        time_source=estimate.get("time_source"),
        notes=(SCALING_NOTE,) if len(gpus) > 1 else (),
    )


def row_from_refusal(
    machine: str, gpu: str | None, count: int, message: str, alternatives: Sequence[Mapping[str, Any]]
) -> MachineRow:
    """A machine where the config does not fit as asked: the best alternative instead of hours."""
    best = next((a for a in alternatives if a.get("fits")), None)
    return MachineRow(
        machine=machine,
        gpu=gpu,
        count=count,
        fits=False,
        verdict="does not fit",
        alternative=dict(best) if best else None,
        message=message,
    )


def order(rows: Sequence[MachineRow]) -> list[MachineRow]:
    """Fastest first; machines where nothing fits (or with no time) last, in the order given."""
    return sorted(rows, key=lambda r: r.central_hours)
