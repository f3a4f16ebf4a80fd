"""The Slurm engine: the run's supervisor in a Slurm batch job (ftlaunch.run.slurm: the job script,
the batch step, the Slurm commands).

It asks the planner for the job's nodes (``--gpu A100-80GBx8 --nodes 2``: two nodes of 8 GPUs; the
planner plans nodes x processes per node, on CPU nodes too) and takes its plan as final; `start_run`
checks that plan as for any run, creates the run and hands it here: the output_dir lock is let go
(the job's supervisor takes it again on the batch host), job.sbatch and srun-trainer.sh are written
and submitted; a submission sbatch refuses leaves nothing behind. Status is Slurm's word while it
holds the job (queued, starting), the supervisor's once it runs; stop is scancel (after a
`stop_requested` event the batch step reads); resume from a login node submits job.sbatch again.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ftlaunch.errors import BusyError, StateError
from ftlaunch.run import progress as prog
from ftlaunch.run import transitions as journal
from ftlaunch.run.engines.base import Created, EngineStatus, Resumed, ResumeOutcome, Started
from ftlaunch.run.events import Event
from ftlaunch.run.slurm import beat
from ftlaunch.run.slurm import sbatch as slurm
from ftlaunch.run.slurm.submit import one_node_named, write_and_submit
from ftlaunch.run.state import RunState, RunStatus
from ftlaunch.run.store import RunFolder, read_state
from ftlaunch.run.trainer import find_trainer

if TYPE_CHECKING:
    from ftlaunch.plan.planner import Plan
    from ftlaunch.run.prepare import PlanRequest


@dataclass(frozen=True)
class Slurm:
    """A Slurm batch job over ``job.nodes`` nodes; ``cwd`` is the submitting shell's directory (the
    job's PWD), read at the edge."""

    job: slurm.SlurmRequest | None = None
    cwd: str | Path | None = None
    name: ClassVar[str] = "slurm"

    def _job(self) -> slurm.SlurmRequest:
        if self.job is None:
            raise ValueError("the slurm engine launches only with a SlurmRequest (Slurm(job=...))")
        return self.job

    def request(self, req: PlanRequest) -> PlanRequest:
        """The job's machine: `--nodes M` nodes of the one `--gpu` names (CARDxN, or none: CPU nodes)."""
        one_node_named(req.gpu)
        return replace(req, nodes=self._job().nodes)

    def adapt(self, p: Plan) -> Plan:
        """Nothing: the planner planned the nodes x processes per node; its plan is final."""
        return p

    def launch(self, created: Created, env: Mapping[str, str]) -> Started:
        """Write job.sbatch and srun-trainer.sh and sbatch them; a refused submission removes the run."""
        if created.lock is not None:
            created.lock.close()  # the job's supervisor takes it on the batch host
        job = self._job()
        p = created.plan  # the layout is the plan's: its nodes (one for a one-process config), each node's GPUs
        job = replace(
            job, nodes=p.nodes, gpus_per_node=p.hardware.gpus_per_node, processes_per_node=p.processes_per_node
        )
        try:
            trainer = find_trainer(env)
            job_id, notes = write_and_submit(created.run_dir, created.plan, job, trainer, env, self.cwd or ".")
        except BaseException:
            shutil.rmtree(created.run_dir, ignore_errors=True)  # a job never submitted leaves no run behind
            raise
        return Started(created.run_dir, job=job_id, notes=tuple(notes))

    def status(self, state: RunState, env: Mapping[str, str]) -> EngineStatus:
        """Queued/starting while Slurm holds the job and no supervisor has taken over; the supervisor's
        own status while the job runs; lost when Slurm no longer runs the job and no final status was
        written. From squeue and scontrol, so it works without accounting (sacct); when no Slurm
        command answers, the recorded status stands (it may be alive: fail closed). The local pid
        says nothing here: the supervisor runs on the job's first node."""
        recorded = state.status
        if not state.job.submitted:
            return EngineStatus(recorded)  # never submitted
        info = slurm.query_job(str(state.job.id), env)
        job_state = info.state
        if not info.known:
            return EngineStatus(recorded)
        if job_state in slurm.ACTIVE_STATES:
            if recorded in (RunStatus.RUNNING, RunStatus.RECOVERING) and job_state not in slurm.QUEUED_STATES:
                if silent := _batch_step_silent(state):
                    return EngineStatus(RunStatus.LOST, f"{job_state}; its batch step silent for {silent:.0f} s")
                return EngineStatus(recorded, job_state)
            return EngineStatus(RunStatus(slurm.status_of(job_state) or recorded.value), job_state)
        if recorded.is_terminal():
            return EngineStatus(recorded, job_state)
        return EngineStatus(RunStatus.LOST, job_state)

    def stop(self, run_dir: Path, state: RunState, env: Mapping[str, str], grace: float) -> str | None:
        """scancel the run's job while Slurm holds it: its batch step stops the supervisor, which
        stops the trainer gracefully. None when the job is over (then stop as any run)."""
        job = state.job.id
        if not job:
            return None
        job_state = slurm.job_state(job, env)
        if job_state not in slurm.ACTIVE_STATES:
            return None
        # Before the scancel: the batch step reads it to tell this stop from Slurm's own SIGTERM
        # (a requeue or a preemption), which must never read as a user's stop.
        journal.note(run_dir, Event.STOP_REQUESTED, job_id=job, slurm_state=job_state)
        slurm.cancel(job, env)
        journal.note(run_dir, Event.SCANCEL, job_id=job, slurm_state=job_state)
        if job_state in slurm.QUEUED_STATES:
            journal.stopped(run_dir, "cancelled while queued")
            return f"run {run_dir.name}: Slurm job {job} cancelled while {job_state.lower()}"
        # Done when the supervisor has recorded the stop and Slurm has let the job go: until then a
        # stopped supervisor inside a still-active job reads as a job about to be requeued.
        deadline = time.monotonic() + grace + 30
        while time.monotonic() < deadline:
            if _status_now(run_dir).is_terminal() and slurm.job_state(job, env) not in slurm.ACTIVE_STATES:
                return f"run {run_dir.name} stopped (Slurm job {job} cancelled)"
            time.sleep(0.2)
        if _status_now(run_dir).is_terminal():
            return f"run {run_dir.name} stopped; Slurm still lists job {job} as active"
        return f"run {run_dir.name}: Slurm job {job} cancelled; its supervisor has not recorded the stop yet"

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
        """From a login node: nothing while Slurm holds its job (it resumes when it runs); else the same
        job.sbatch is submitted again (same run directory; the job resumes from the last complete
        checkpoint). A job Slurm cannot answer for may be alive: refused, nothing submitted. Inside
        the run's own job (the batch step's `resume --foreground`): None, restart here."""
        if not state.job.id or env.get("SLURM_JOB_ID") == state.job.id:
            return None
        job = state.job.id
        info = slurm.query_job(job, env)
        if not info.known:
            raise BusyError(
                f"run {run_dir.name}: Slurm did not answer for job {job}; it may still be alive, so nothing was "
                "submitted",
                hint="try again once squeue works",
            )
        if info.active:
            if overrides:
                raise BusyError(
                    f"run {run_dir.name} is Slurm job {job} ({info.state}): its config cannot change under it",
                    hint=f"stop it first (`ftlaunch stop {run_dir.name}`), then resume with the change",
                )
            return Resumed(ResumeOutcome.IN_SLURM, job=job, slurm_state=info.state)
        if state.status is RunStatus.SUCCEEDED:
            return Resumed(ResumeOutcome.FINISHED, exit_code=0)
        _output_dir_free(run_dir, state, env)
        edit()
        last = prog.last_complete_checkpoint(Path(state.output_dir or ""))
        new_job = slurm.submit(RunFolder(run_dir).job_script, {**env, **({} if cwd is None else {"PWD": str(cwd)})})
        frm = last[1].name if last else "the start"
        journal.resubmitted(
            run_dir,
            state,
            new_job,
            previous_job=job,
            allow_env_change=allow_env_change,  # the job's supervisor compares on its node
            message=f"resubmitted as Slurm job {new_job}; resumes from {frm} when it runs",
            slurm_state=info.state,
            from_checkpoint=last[1].name if last else None,
        )
        return Resumed(ResumeOutcome.RESUBMITTED, job=new_job)


def _output_dir_free(run_dir: Path, state: RunState, env: Mapping[str, str]) -> None:
    """No run of this machine may hold the output_dir now; the job's supervisor takes the lock itself."""
    from ftlaunch.run.outdir import OutputDirBusy, acquire_output_lock

    try:
        acquire_output_lock(env, state.output_dir or "", run_dir.name).close()
    except OutputDirBusy as exc:
        if exc.holder != run_dir.name:
            raise
        raise BusyError(f"run {run_dir.name} is being started by another process right now") from None


def _batch_step_silent(state: RunState) -> float | None:
    """Seconds the run's batch step has written no heartbeat and its supervisor no state, when over the
    limit (slurm/beat.py): a job killed whole, slurmstepd too, that Slurm still lists. None: alive, or
    nothing to tell by (a job of an older ftlaunch)."""
    from datetime import datetime

    try:
        written = datetime.fromisoformat(state.updated).timestamp() if state.updated else None
    except ValueError:
        written = None
    last = beat.read_beat(Path(state.run_dir or ""))
    return beat.silent_for(last, str(state.job.id), written, time.time())


def _status_now(run_dir: Path) -> RunStatus:
    """The recorded status, LOST while state.json cannot be read (a stop polls it)."""
    try:
        return read_state(run_dir).status
    except StateError:
        return RunStatus.LOST
