"""ray.json in a Ray run's folder: the head's address, one submission id per attempt, and the
follower's pid. Written whole and atomically (``write_json_atomic``); what any shell that reaches
the head needs to find the run's job again (`status`, `logs`, `stop`, `resume`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ftlaunch.errors import StateError
from ftlaunch.files import JSON_LIMIT, read_user_bytes, write_json_atomic

RECORD = "ray.json"


@dataclass(frozen=True)
class Submission:
    """One attempt submitted as a job."""

    id: str
    submitted: float  # epoch seconds
    resume_from: str | None = None
    why: str | None = None  # what the submission follows: "start", "driver killed", "resume"


@dataclass(frozen=True)
class RayRecord:
    address: str
    submissions: tuple[Submission, ...] = ()
    follower_pid: int | None = None
    follower_start: float | None = None
    cpus: float | None = None  # what each job's driver asks of its node (Ray places it by these)
    gpus: float | None = None
    env_vars: dict[str, str] = field(default_factory=dict)  # the job's runtime_env env_vars (no secrets)

    @property
    def current(self) -> Submission | None:
        return self.submissions[-1] if self.submissions else None

    def next_id(self, run_id: str) -> str:
        """A new submission id: the run's id and the attempt's number (Ray never takes an id twice)."""
        return f"ftlaunch-{run_id}-{len(self.submissions) + 1}"

    def with_submission(self, s: Submission) -> RayRecord:
        return replace(self, submissions=(*self.submissions, s))

    def to_json(self) -> dict[str, Any]:
        return {
            "version": 1,
            "address": self.address,
            "submissions": [s.__dict__ for s in self.submissions],
            "follower_pid": self.follower_pid,
            "follower_start": self.follower_start,
            "cpus": self.cpus,
            "gpus": self.gpus,
            "env_vars": dict(self.env_vars),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RayRecord:
        return cls(
            address=str(d["address"]),
            submissions=tuple(Submission(**s) for s in d.get("submissions") or ()),
            follower_pid=d.get("follower_pid"),
            follower_start=d.get("follower_start"),
            cpus=d.get("cpus"),
            gpus=d.get("gpus"),
            env_vars=dict(d.get("env_vars") or {}),
        )


def is_ray_run(run_dir: Path) -> bool:
    return (run_dir / RECORD).exists()


def read_record(run_dir: Path) -> RayRecord:
    path = run_dir / RECORD
    try:
        data = read_user_bytes(path, limit=JSON_LIMIT, what=str(path), error=StateError)
        return RayRecord.from_json(json.loads(data))
    except FileNotFoundError:
        raise StateError(f"run {run_dir.name} is not a Ray run (no {RECORD})") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StateError(f"{path} cannot be read ({exc})") from None


def write_record(run_dir: Path, record: RayRecord) -> None:
    write_json_atomic(run_dir / RECORD, record.to_json())
