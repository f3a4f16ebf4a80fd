"""The names of a run's events (events.jsonl), one enum. Pure: names only.

Each line of events.jsonl is ``{"t": ..., "event": NAME, ...}``. The names are the file format: runs of
every earlier version wrote them and `status`, `runs`, the estimate's history and the notifier read
them back, so a member's value never changes (tests/run/test_events.py pins every one). A reader
matches ``e.get("event") == Event.X`` (a StrEnum equals its value); only the journal
(ftlaunch.run.journal, ftlaunch.run.transitions) writes them.
"""

from __future__ import annotations

from enum import StrEnum


class Event(StrEnum):
    # a run's life
    CREATED = "created"
    OUTPUT_DIR_CLAIMED = "output_dir_claimed"
    STATE_REBUILT = "state_rebuilt"
    CONFIG_EDITED = "config_edited"
    REPLANNED = "replanned"
    RESUMED = "resumed"
    STOP_REQUESTED = "stop_requested"
    ORPHAN_STOPPED = "orphan_stopped"
    CHECKPOINT_LR_REWRITTEN = "checkpoint_lr_rewritten"
    # the supervisor's attempts
    ATTEMPT_STARTED = "attempt_started"
    CHECKPOINT_SET_ASIDE = "checkpoint_set_aside"
    STOPPING = "stopping"
    RECOVERED = "recovered"
    CHECKPOINT = "checkpoint"
    PARTIAL_CHECKPOINT_REMOVED = "partial_checkpoint_removed"
    GPU_WAIT = "gpu_wait"
    EXITED = "exited"
    RETRY = "retry"
    UNWRITTEN = "unwritten"
    # numeric health (ftlaunch.run.rollback)
    END_JUDGED = "end_judged"
    ROLLED_BACK = "rolled_back"
    # the trainer's environment (ftlaunch.run.environment)
    ENVIRONMENT = "environment"
    ENVIRONMENT_CHANGED = "environment_changed"
    ENVIRONMENT_UNREADABLE = "environment_unreadable"
    # how a run ended: the supervisor writes the end's status as its event (``ended_as``)
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"
    DIVERGED = "diverged"  # also the first bad record of an attempt (numeric health)
    STALLED = "stalled"  # also the watchdog's halt of an attempt
    NO_PROGRESS = "no_progress"
    DISK_FULL = "disk_full"
    ENV_CHANGED = "env_changed"
    ENDED = "ended"  # a Slurm batch step's end before its trainer started (rendezvous)
    # notices
    NOTIFIED = "notified"
    NOTIFY_CONFIG_ERROR = "notify_config_error"
    LOST_NOTICED = "lost_noticed"
    # Slurm (ftlaunch.run.slurm, ftlaunch.run.engines.slurm)
    SUBMITTED = "submitted"
    RESUBMITTED = "resubmitted"
    SLURM_JOB_STARTED = "slurm_job_started"
    SLURM_NOT_RESUMED = "slurm_not_resumed"
    MASTER_ADDR = "master_addr"
    SLURM_SIGNAL = "slurm_signal"
    REQUEUED = "requeued"
    REQUEUE_FAILED = "requeue_failed"
    REQUEUED_BY_SLURM = "requeued_by_slurm"
    ENDED_BY_SLURM = "ended_by_slurm"
    SCANCEL = "scancel"
    # Ray (ftlaunch.run.ray)
    RAY_SUBMITTED = "ray_submitted"
    RAY_JOB_ENDED = "ray_job_ended"
    RAY_RESUBMIT_FAILED = "ray_resubmit_failed"
    ENGINE_UNREACHABLE = "engine_unreachable"
    ENGINE_REACHABLE = "engine_reachable"
    FOLLOWER_GAVE_UP = "follower_gave_up"

    @classmethod
    def ended_as(cls, status: str) -> Event:
        """The event of a run's end with this (terminal) status: its name is the status's."""
        return cls(str(status))
