"""The options that define a run, shared by `train` and `schedule add` (and stored by the latter).

A scheduled run must be the same run `train` would start: both build their plan request and their
run settings from one `RunOptions` value, so an option added here reaches both.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from ftlaunch.run.health import OnDiverge
from ftlaunch.run.prepare import PlanRequest, PlanSettings


@dataclass(frozen=True)
class SupervisorSettings:
    """How the supervisor keeps one run going, built once from RunOptions and passed whole to
    `create_run` (recorded in the run's state)."""

    name: str | None = None
    recover: bool = True
    max_retries: int = 4
    max_crash_retries: int = 2
    on_diverge: OnDiverge = OnDiverge.ROLLBACK  # numeric health (ftlaunch.run.health)
    stall_timeout: float | None = None  # the stall watchdog (ftlaunch.run.stall); None: derived
    max_stall_restarts: int = 2


@dataclass(frozen=True)
class RunOptions(PlanSettings):
    """What to plan for (PlanSettings: hardware, batch, memory policy, hub) and how the supervisor behaves."""

    run_name: str | None = None
    max_retries: int = 4
    max_crash_retries: int = 2
    no_recover: bool = False
    on_diverge: OnDiverge = OnDiverge.ROLLBACK  # numeric health (run.health): parsed where it comes in
    stall_timeout: float | None = None  # the stall watchdog (ftlaunch.run.stall); None: derived
    max_stall_restarts: int = 2

    @classmethod
    def from_kwargs(cls, kw: dict[str, Any]) -> RunOptions:
        """Take the known keys out of a click kwargs dict (the rest stays in it)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: kw.pop(k) for k in list(kw) if k in known and kw[k] is not None})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunOptions:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in d.items() if k in known and v is not None}
        if "on_diverge" in values:  # a stored record holds the word
            values["on_diverge"] = OnDiverge(values["on_diverge"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def absolute(self, cwd: str | Path) -> RunOptions:
        """File options made absolute, for a record replayed later from another directory (cron)."""

        def ab(p: str | None) -> str | None:
            return None if p is None else str(Path(cwd, p).absolute())

        return replace(self, hardware_file=ab(self.hardware_file), model_config=ab(self.model_config))

    def plan_request(
        self,
        config: str,
        overrides: tuple[str, ...],
        *,
        strict: bool,
        cwd: str | None = None,
        progress: bool = False,
    ) -> PlanRequest:
        """The planner's request: `strict` is train (missing files are errors, weights downloaded)."""
        shared = {f.name: getattr(self, f.name) for f in fields(PlanSettings)}
        return PlanRequest(
            config=config,
            overrides=tuple(overrides),
            download_weights=strict and self.mirror is not None,
            strict_files=strict,
            cwd=cwd,
            progress=progress,
            **shared,
        )

    def supervisor_settings(self) -> SupervisorSettings:
        """What `create_run` records of how the supervisor behaves (name, recovery budget)."""
        return SupervisorSettings(
            name=self.run_name,
            recover=not self.no_recover,
            max_retries=self.max_retries,
            max_crash_retries=self.max_crash_retries,
            on_diverge=self.on_diverge,
            stall_timeout=self.stall_timeout,
            max_stall_restarts=self.max_stall_restarts,
        )
