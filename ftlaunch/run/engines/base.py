"""The engine seam: what an engine is (``Engine``, a protocol) and the values that cross it.

An engine is where a run's supervisor lives: on this machine (``local``), in a Slurm batch job
(``slurm``), ... `start_run` (run/launch.py) plans, checks (LLaMA-Factory's parser, the disk forecast,
the simulation of a tight plan) and creates every run the same way; the engine adds only what differs:

- ``request(req)`` / ``adapt(plan)``: the machine it plans for and its final word on the plan (Slurm:
  the nodes' GPUs together; CPU nodes spread the global batch over one process each), before the
  checks see the plan;
- ``launch(created, env)``: start the created run (the output_dir lock held for it is handed over);
- ``status(state, env)``: what the run is now, as the engine sees it;
- ``stop(run_dir, state, env, grace)`` / ``resume(run_dir, state, env, ...)``: act on it, or None when
  the run's supervisor is to be found on this machine (then `run/control.py`'s own path acts).

An engine instance carries its launch options (``Local(foreground=True)``, ``Slurm(request)``); the
one built with none (``engines.get(name)()``) serves status, stop and resume of a recorded run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ftlaunch.plan.planner import Plan
    from ftlaunch.run.prepare import PlanRequest
    from ftlaunch.run.state import RunState, RunStatus


@dataclass(frozen=True)
class Created:
    """A run folder written completely, with the output_dir lock held for it (the engine hands it to
    the supervisor, or lets go of it where the supervisor takes it again elsewhere)."""

    run_dir: Path
    plan: Plan
    lock: IO[str] | None


@dataclass(frozen=True)
class Started:
    """A run handed to its engine: detached (``pid``), run to its end here (``exit_code``), or
    submitted to a scheduler (``job``, with ``notes`` the user should read)."""

    run_dir: Path
    pid: int | None = None
    exit_code: int | None = None
    job: str | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineStatus:
    """What a run is now, as its engine sees it: the status to show and the scheduler's own word
    for the job (Slurm's job state), when there is one."""

    status: RunStatus
    job_state: str | None = None


class ResumeOutcome(StrEnum):
    ALIVE = "alive"  # its supervisor lives: nothing restarted (``pid``: the supervisor's)
    FINISHED = "finished"  # it succeeded: nothing to do
    RESTARTED = "restarted"  # a new detached supervisor (``pid``)
    FOREGROUND = "foreground"  # restarted and run to its end here (``exit_code``)
    IN_SLURM = "in_slurm"  # a Slurm run whose job Slurm still holds (``job``, ``slurm_state``): nothing done
    RESUBMITTED = "resubmitted"  # an engine's run submitted again (``job``: the new job id, ``engine_label``)


@dataclass(frozen=True)
class Resumed:
    outcome: ResumeOutcome
    pid: int | None = None
    exit_code: int | None = None
    job: str | None = None
    slurm_state: str | None = None
    engine_label: str = "Slurm"  # how the job's engine is named to the user ("Slurm job 12", "Ray job ftlaunch-...")


@runtime_checkable
class Engine(Protocol):
    """Where a run's supervisor lives. Implementations: ``run/engines/local.py``, ``run/engines/slurm.py``."""

    name: str

    def request(self, req: PlanRequest) -> PlanRequest:
        """The plan request for this engine's machine (default: ``req`` as it is)."""
        ...

    def adapt(self, p: Plan) -> Plan:
        """The engine's final word on the plan, before it is checked (default: ``p``)."""
        ...

    def launch(self, created: Created, env: Mapping[str, str]) -> Started:
        """Start a created run; ``created.lock`` is this call's to hand over or close."""
        ...

    def status(self, state: RunState, env: Mapping[str, str]) -> EngineStatus:
        """What the run is now (an engine that cannot tell keeps the recorded status: fail closed)."""
        ...

    def stop(self, run_dir: Path, state: RunState, env: Mapping[str, str], grace: float) -> str | None:
        """Stop the run where the engine holds it and say so; None: its supervisor is on this machine."""
        ...

    def resume(
        self,
        run_dir: Path,
        state: RunState,
        env: Mapping[str, str],
        *,
        edit: Callable[[], None],
        overrides: tuple[str, ...],
        cwd: str | Path | None,
        allow_env_change: bool,
    ) -> Resumed | None:
        """Resume the run through the engine (``edit()`` applies the config edits first); None: restart
        it here, on this machine, as a local run."""
        ...
