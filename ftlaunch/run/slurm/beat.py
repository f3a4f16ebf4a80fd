"""The batch step's heartbeat: `slurm-beat.json` in the run folder, rewritten every BEAT_S seconds by
``ftlaunch.run.slurm.job`` while its supervisor runs ({"job": JOBID, "t": epoch seconds}).

Why: when every process of a job dies at once, its slurmstepd included (a `kill -9` of all of them),
nothing tells slurmctld, which lists the job RUNNING until a node registers without it: 80+ s in
fault run 5, minutes on the local cluster. The run folder is on storage every node sees, so `status`
on the login node can read that the batch step has gone silent (``silent_for``). A status only: what
acts on a job (`resume`, `stop`) still asks Slurm, and a job Slurm lists as active is never submitted
again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ftlaunch.files import write_json_atomic

BEAT = "slurm-beat.json"
BEAT_S = 2.0  # how often the batch step writes it
SILENT_S = 15.0  # no beat (and no state written) for this long: the batch step is gone


def beat(run_dir: Path, job_id: str, now: float | None = None) -> None:
    """Write the heartbeat (atomically: a reader sees the old one or the new one)."""
    write_json_atomic(run_dir / BEAT, {"job": str(job_id), "t": time.time() if now is None else now})


def read_beat(run_dir: Path) -> dict | None:
    """The last heartbeat, None when there is none or it cannot be read (an older ftlaunch wrote none)."""
    try:
        got = json.loads((run_dir / BEAT).read_text())
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def silent_for(last_beat: dict | None, job_id: str, last_write: float | None, now: float) -> float | None:
    """Seconds the job's batch step has been silent, when that is over SILENT_S; else None. Pure.

    ``last_beat``: the heartbeat read; one of another job (an earlier job of the run) or none says
    nothing. ``last_write``: when the run's state was last written (epoch seconds): the supervisor's own
    word counts as a sign of life too, so a run is called silent only when neither has spoken."""
    if not last_beat or str(last_beat.get("job")) != str(job_id):
        return None
    try:
        t = float(last_beat["t"])
    except (KeyError, TypeError, ValueError):
        return None
    latest = max(t, last_write or 0.0)
    silent = now - latest
    return silent if silent > SILENT_S else None
