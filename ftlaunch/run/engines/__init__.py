"""ftlaunch.run.engines: where a run's supervisor lives, behind one seam (base.Engine: request, adapt,
launch, status, stop, resume), and the registry of engines by name.

`start_run` (run/launch.py) is the one way a run starts, whatever the engine: plan, LLaMA-Factory's
parser preflight, the disk forecast and the simulation of a tight plan run for every engine, then the
engine launches the created run. `status`, `stop` and `resume` ask the run's engine (``of_state``).

The registry maps a name to a loader that imports the engine's module only when the engine is named:
`import ftlaunch` (and `status` of a local run) never loads an engine's dependencies (Slurm commands,
ray, ...). An engine is one module here, one loader and one row in ``ENGINES``.

May import: the ground, ftlaunch.plan, ftlaunch.hub and the rest of ftlaunch.run (never launch or
control, which call the engines).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ftlaunch.errors import ConfigError, StateError
from ftlaunch.run.engines.base import Created, Engine, EngineStatus, Resumed, ResumeOutcome, Started

if TYPE_CHECKING:
    from ftlaunch.run.state import RunState

__all__ = ["ENGINES", "Created", "Engine", "EngineStatus", "ResumeOutcome", "Resumed", "Started", "get", "names"]


def _local() -> Callable[..., Engine]:
    from ftlaunch.run.engines.local import Local

    return Local


def _slurm() -> Callable[..., Engine]:
    from ftlaunch.run.engines.slurm import Slurm

    return Slurm


def _ray() -> Callable[..., Engine]:
    from ftlaunch.run.engines.ray import Ray

    return Ray


# name -> loader of the engine's class (called with the engine's launch options, or none to act on a
# recorded run). A row's module is imported only when its engine is named.
ENGINES: dict[str, Callable[[], Callable[..., Engine]]] = {
    "local": _local,
    "slurm": _slurm,
    "ray": _ray,
}


def names() -> tuple[str, ...]:
    """The engines `--engine` takes, in the registry's order."""
    return tuple(ENGINES)


def get(name: str) -> Callable[..., Engine]:
    """The engine class registered as ``name`` (its module imported now); ConfigError when none is."""
    try:
        loader = ENGINES[name]
    except KeyError:
        raise ConfigError(f"no engine {name!r}", hint=f"one of: {', '.join(names())}") from None
    return loader()


def of_state(state: RunState) -> Engine:
    """The engine of a recorded run (its state's ``engine``; a run written before engines were
    recorded is Slurm's when it has Slurm keys), built without launch options. A run of an engine this
    ftlaunch does not know (written by a newer one) is a StateError: `runs` shows it unreadable, and
    nothing acts on it."""
    name = state.engine_name()
    if name not in ENGINES:
        raise StateError(
            f"run {state.id} runs on engine {name!r}, which this ftlaunch does not know; not touching it",
            hint=f"use the ftlaunch version that started it (engines here: {', '.join(names())})",
        )
    return get(name)()
