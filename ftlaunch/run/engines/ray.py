"""The Ray engine: the run's supervisor as a Ray job (ftlaunch.run.ray: the cluster, the Jobs API,
ray.json, the follower). `train cfg.yaml --engine ray [--address URL]` (RAY_ADDRESS otherwise).

It plans for the cluster's own resources (its largest node, from the dashboard), refuses
LLaMA-Factory's own Ray mode where its placement group cannot fit, and hands the created run to a
job whose entrypoint is ftlaunch's supervisor: the output_dir lock is let go (the supervisor takes it
again on the node), the first attempt is submitted (one submission id per attempt) and a follower
is started here, detached, to submit the next attempt when the job fails from outside. Status is
the supervisor's own with the job's word beside it ("engine unreachable" when the head does not
answer: never failed); stop is Ray's stop after a `stop_requested` event (never retried); resume
from any shell submits the next attempt, inside the run's own job it restarts there.

The ``ray`` package (the ``ray`` extra) is imported by ftlaunch.run.ray.jobs only, when a job is touched.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ftlaunch.run.engines.base import Created, EngineStatus, Resumed, ResumeOutcome, Started
from ftlaunch.run.ray import jobs
from ftlaunch.run.ray.machine import cluster_request
from ftlaunch.run.ray.record import is_ray_run, read_record, write_record
from ftlaunch.run.ray.submit import (
    SUBMISSION_ENV,
    address_for_record,
    first_submission,
    job_status,
    refuse_beside_active,
    resubmit_by_hand,
    start_follower,
    stop_job,
)
from ftlaunch.run.state import RunState, RunStatus

if TYPE_CHECKING:
    from ftlaunch.plan.planner import Plan
    from ftlaunch.run.prepare import PlanRequest


@dataclass(frozen=True)
class Ray:
    """A Ray cluster's head, by its dashboard URL (``jobs.address_of``: --address, else RAY_ADDRESS);
    ``env``: the submitting shell's environment (read at the edge), what the job's env is made of."""

    address: str | None = None
    env: Mapping[str, str] | None = None
    name: ClassVar[str] = "ray"

    def _address(self) -> str:
        return jobs.address_of(self.address, self.env or {})

    def request(self, req: PlanRequest) -> PlanRequest:
        """The cluster's largest node as the machine; LLaMA-Factory's Ray mode refused when it cannot fit."""
        jobs.require_extra()
        return cluster_request(req, self.env or {}, self._address())

    def adapt(self, p: Plan) -> Plan:
        return p

    def launch(self, created: Created, env: Mapping[str, str]) -> Started:
        """Submit the first attempt and start the follower; a submission Ray refuses removes the run, as
        does another Ray run into the output_dir that is not over (exit 7, checked under the lock)."""
        try:
            refuse_beside_active(created.run_dir, env, str(created.plan.config.get("output_dir") or ""))
            if created.lock is not None:
                created.lock.close()  # the job's supervisor takes it on its node
            sid = first_submission(created.run_dir, env, self._address(), created.plan.env)
        except BaseException:
            if created.lock is not None:
                created.lock.close()
            shutil.rmtree(created.run_dir, ignore_errors=True)  # a job never submitted leaves no run behind
            raise
        pid = start_follower(created.run_dir, env)
        return Started(created.run_dir, pid=pid, job=sid)

    def status(self, state: RunState, env: Mapping[str, str]) -> EngineStatus:
        run_dir = Path(state.run_dir or "")
        if not is_ray_run(run_dir):
            return EngineStatus(state.status)
        status, word = job_status(run_dir)
        return EngineStatus(status, word)

    def stop(self, run_dir: Path, state: RunState, env: Mapping[str, str], grace: float) -> str | None:
        if not is_ray_run(run_dir):
            return None
        return stop_job(run_dir, grace)

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
        """Inside the run's own job (the entrypoint's `resume --foreground`): None, restart here. From
        any other shell: the job's follower again while the job runs; else the next attempt."""
        if not is_ray_run(run_dir):
            return None
        record = read_record(run_dir)
        if record.current is not None and env.get(SUBMISSION_ENV) == record.current.id:
            return None
        if state.status is RunStatus.SUCCEEDED:
            return Resumed(ResumeOutcome.FINISHED, exit_code=0)
        # A new head (the old one gone): --address, else RAY_ADDRESS of the resuming shell.
        new = self.address or env.get("RAY_ADDRESS")
        write_record(run_dir, address_for_record(record, new and jobs.address_of(new, env)))
        sid = resubmit_by_hand(run_dir, env, edit, changes=bool(overrides))
        if sid is None:
            return Resumed(ResumeOutcome.ALIVE, job=record.current.id if record.current else None, engine_label="Ray")
        return Resumed(ResumeOutcome.RESUBMITTED, job=sid, engine_label="Ray")
