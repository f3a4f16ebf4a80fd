"""The options that define a run, shared by `train` and `schedule add` (and stored by the latter).

A scheduled run must be the same run `train` would start: both build their plan request and their
run settings from one `RunOptions` value, so an option added here reaches both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ftlaunch.run.policy import RecoveryPolicy
from ftlaunch.run.prepare import PlanRequest, PlanSettings


@dataclass(frozen=True)
class SupervisorSettings:
    """How the supervisor keeps one run going, built once from RunOptions and passed whole to
    `create_run`, which records it in the run's state (``RecoveryPolicy.state_fields``)."""

    name: str | None = None
    policy: RecoveryPolicy = RecoveryPolicy()


@dataclass(frozen=True)
class RunOptions(PlanSettings):
    """What to plan for (PlanSettings: hardware, batch, memory policy, hub) and how the supervisor behaves
    (the run's name and its RecoveryPolicy, whose options come from ftlaunch.run.policy.OPTIONS).

    Stored (a schedule record) flat, as `train` takes them: the policy as its options' keywords
    (``max_retries``, ``no_recover``, ...), so a record written before the policy was one value reads."""

    run_name: str | None = None
    policy: RecoveryPolicy = RecoveryPolicy()

    @classmethod
    def keys(cls) -> frozenset[str]:
        """The keys of a stored record (``to_dict``)."""
        return frozenset(f.name for f in fields(cls) if f.name != "policy") | RecoveryPolicy.dests()

    @classmethod
    def from_kwargs(cls, kw: dict[str, Any]) -> RunOptions:
        """Take the known keys out of a click kwargs dict (the rest stays in it)."""
        return cls.from_dict({k: kw.pop(k) for k in list(kw) if k in cls.keys() and kw[k] is not None})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunOptions:
        """A stored record (or click's keywords): the policy's keys make its policy; absent or None: the default."""
        known = {f.name for f in fields(cls)} - {"policy"}
        values = {k: v for k, v in d.items() if k in known and v is not None}
        return cls(**values, policy=RecoveryPolicy.from_options(d))

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "policy"}
        return {**out, **self.policy.to_options()}

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
        """What `create_run` records of how the supervisor behaves (name, recovery policy)."""
        return SupervisorSettings(name=self.run_name, policy=self.policy)
