"""The memory model's answer as values: the verdict, the predicted figures of the plan's setup
(``MemoryPrediction``, a plan's ``memory``) and the rows of what would fit when nothing does
(``Alternative``). ``to_dict`` gives plan.json's and ``plan --json``'s shape, key for key and in
order; ``from_dict`` reads it back (a run's plan.json, an estimate's JSON). The simulator's
measurement is not a prediction: a Plan keeps it beside (``Plan.simulated``), and ``memory_json``
joins them as plan.json has it. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

from ftlaunch.plan.memory.peak import MemoryEstimate


class Verdict(StrEnum):
    FITS = "fits"  # within the target headroom
    TIGHT = "tight"  # within the physical memory, with less than the target headroom
    DOES_NOT_FIT = "does_not_fit"

    @property
    def shown(self) -> str:
        """How the memory table says it."""
        return {Verdict.FITS: "fits", Verdict.TIGHT: "TIGHT", Verdict.DOES_NOT_FIT: "DOES NOT FIT"}[self]


class Kind(StrEnum):
    """Kinds of alternatives, ordered by how much they change the training."""

    SAME_NUMBERS = "same-numbers"  # the same optimisation, bit for bit or nearly (offload, recompute)
    NUMERICS = "numerics"  # the same method with slightly different arithmetic (8-bit states, bf16 weights)
    METHOD = "method"  # a different method or data (LoRA, QLoRA, shorter cutoff)
    HARDWARE = "hardware"  # more GPUs


@dataclass(frozen=True)
class Alternative:
    """One option of the does-not-fit table: what it changes, its predicted peak and whether it fits.

    ``why`` is the memory's or host RAM's reason it does not fit (or is tight); ``refused`` the
    trainer's refusal, which overrides it (the row is then never offered as fitting)."""

    option: str
    kind: Kind
    peak_gib: float
    host_gib: float
    fits: bool
    verdict: Verdict
    change: Mapping[str, Any]
    speed: str
    why: str | None = None
    offloads: bool = False  # it needs host RAM: the row says how much the machine has (host_ram_gib)
    host_ram_gib: float | None = None
    refused: str | None = None

    @property
    def reason(self) -> str | None:
        """What the table says when the option does not fit."""
        return self.refused or self.why

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "option": self.option,
            "kind": self.kind.value,
            "peak_gib": self.peak_gib,
            "host_gib": self.host_gib,
            "fits": self.fits,
            "verdict": self.verdict.value,
            "change": dict(self.change),
            "speed": self.speed,
        }
        if self.why:
            out["why"] = self.why
        if self.offloads:
            out["host_ram_gib"] = self.host_ram_gib
        if self.refused:  # where a reason stood, the refusal replaces it; else it comes last
            out["why"] = self.refused
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Alternative:
        fits = bool(d.get("fits"))
        return cls(
            option=str(d.get("option")),
            kind=Kind(d["kind"]),
            peak_gib=float(d.get("peak_gib") or 0.0),
            host_gib=float(d.get("host_gib") or 0.0),
            fits=fits,
            verdict=Verdict(d.get("verdict") or (Verdict.FITS if fits else Verdict.DOES_NOT_FIT)),
            change=dict(d.get("change") or {}),
            speed=str(d.get("speed") or ""),
            why=d.get("why"),
            offloads="host_ram_gib" in d,
            host_ram_gib=d.get("host_ram_gib"),
        )


@dataclass(frozen=True)
class MemoryPrediction:
    """What the memory model predicts for the setup a plan chose, on the card it plans for (GiB)."""

    estimate: MemoryEstimate
    capacity_gib: float
    usable_gib: float
    headroom: float  # the target share kept free
    verdict: Verdict
    headroom_gib: float  # what the predicted peak leaves free
    headroom_share: float
    tried: tuple[tuple[int, float], ...] = ()  # (micro_batch, peak_gib), in the order tried
    model_params: int = 0
    optimizer: str = ""
    optimizer_source: str | None = None
    host_ram_gib: float | None = None
    host_ram_note: str | None = None
    correction: float = 1.0  # what scales the formulas' peak (observed on this card before)
    correction_note: str | None = None
    device: str = "gpu"  # "gpu": per card; "host": a CPU plan's process against host RAM (memory/host.py)

    @property
    def fits(self) -> bool:
        return self.verdict is not Verdict.DOES_NOT_FIT

    @property
    def peak_gib(self) -> float:
        return self.estimate.peak_gib

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.estimate.to_dict(),
            "capacity_gib": self.capacity_gib,
            "usable_gib": self.usable_gib,
            "headroom": self.headroom,
            "verdict": self.verdict.value,
            "headroom_gib": self.headroom_gib,
            "headroom_share": self.headroom_share,
            "fits": self.fits,
            "tried": [list(t) for t in self.tried],
            "model_params": self.model_params,
            "optimizer": self.optimizer,
            "optimizer_source": self.optimizer_source,
            "host_ram_gib": self.host_ram_gib,
            "host_ram_note": self.host_ram_note,
            "correction": self.correction,
            "correction_note": self.correction_note,
            "device": self.device,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> MemoryPrediction | None:
        """A plan's ``memory`` read back; None when there is none or it lacks the figures."""
        if not d:
            return None
        try:
            est = MemoryEstimate(**{f.name: d[f.name] for f in fields(MemoryEstimate) if f.name in d})
            verdict = Verdict(d.get("verdict") or (Verdict.FITS if d.get("fits") else Verdict.DOES_NOT_FIT))
            return cls(
                estimate=est,
                capacity_gib=d["capacity_gib"],
                usable_gib=d["usable_gib"],
                headroom=d["headroom"],
                verdict=verdict,
                headroom_gib=d["headroom_gib"],
                headroom_share=d["headroom_share"],
                tried=tuple((int(b), float(p)) for b, p in d.get("tried") or ()),
                model_params=d.get("model_params", 0),
                optimizer=d.get("optimizer", ""),
                optimizer_source=d.get("optimizer_source"),
                host_ram_gib=d.get("host_ram_gib"),
                host_ram_note=d.get("host_ram_note"),
                correction=d.get("correction", 1.0),
                correction_note=d.get("correction_note"),
                device=d.get("device", "gpu"),
            )
        except (KeyError, TypeError, ValueError):
            return None


def memory_json(memory: MemoryPrediction | None, simulated: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """A plan's ``memory`` in plan.json: the prediction and, once run, the simulator's measurement."""
    if memory is None and simulated is None:
        return None
    return {**(memory.to_dict() if memory else {}), **({"simulated": dict(simulated)} if simulated is not None else {})}
