"""The one shell over a Ray cluster: its nodes (the dashboard's state API, plain HTTP) and its jobs
(``ray.job_submission.JobSubmissionClient``: submit, status, logs, stop).

The only module of ftlaunch that imports ``ray`` (the ``ray`` extra: ``pip install 'ftlaunch[ray]'``),
and only inside the functions that talk to jobs: planning, `status` of other runs and
`import ftlaunch` never load it. A head that cannot be reached raises ``EngineUnreachable``: the
run's state is not touched, it is not "failed" (the job may run on).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ftlaunch.errors import FtlaunchError, HardwareError, TrainerError
from ftlaunch.run.ray.cluster import Node, parse_nodes

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
# The Jobs API's words for a job (ray.job_submission.JobStatus).
TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})


class EngineUnreachable(HardwareError):
    """The Ray head (its dashboard) did not answer: the job may run on; nothing is recorded as failed."""


class JobNotFound(FtlaunchError):
    """The head answered and knows no such job: a new head (the old one stopped), or a cleared one."""


def address_of(given: str | None, env: Mapping[str, str]) -> str:
    """The dashboard's URL: --address, else RAY_ADDRESS, else Ray's default; "host:port" gets http://.
    A "ray://" client address is not the Jobs API's: refused with the reason."""
    address = (given or env.get("RAY_ADDRESS") or DEFAULT_ADDRESS).strip().rstrip("/")
    if address.startswith("ray://") or address == "auto":
        raise HardwareError(
            f"--address {address}: the Ray engine talks to the head's dashboard (the Jobs API), not to {address}",
            hint="give the dashboard's URL, e.g. --address http://HEAD:8265 (or RAY_ADDRESS=http://HEAD:8265)",
        )
    return address if "://" in address else f"http://{address}"


def _unreachable(address: str, exc: BaseException) -> EngineUnreachable:
    return EngineUnreachable(
        f"engine unreachable: the Ray head at {address} did not answer ({type(exc).__name__}: {exc})",
        hint="is the head up (`ray status`)? the run is not failed: `ftlaunch resume RUN` continues once it is back",
    )


def nodes(address: str, timeout: float = 10.0) -> tuple[Node, ...]:
    """The alive nodes, from the dashboard's state API (no ray import)."""
    url = f"{address}/api/v0/nodes?detail=1&limit=10000"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return parse_nodes(json.loads(r.read()))
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise _unreachable(address, exc) from None


_NOT_INSTALLED = "--engine ray needs Ray's job client: the ray extra is not installed in this Python"
_INSTALL = "pip install 'ftlaunch[ray]' (ray[default] 2.60.0)"


def require_extra() -> None:
    """TrainerError (exit 13) at once when the ray extra is missing: before a run is planned, not
    at its submission. Finds the package without importing it."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise TrainerError(_NOT_INSTALLED, hint=_INSTALL)


def _client(address: str) -> Any:
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        raise TrainerError(_NOT_INSTALLED, hint=_INSTALL) from None
    try:
        return JobSubmissionClient(address)
    except Exception as exc:  # ConnectionError, and whatever the client raises on a dead head
        raise _unreachable(address, exc) from None


def _call(address: str, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except (ConnectionError, OSError) as exc:
        raise _unreachable(address, exc) from None
    except RuntimeError as exc:  # the client's way of saying "the head answered no"
        text = str(exc)
        if "Failed to connect" in text or "Connection" in text or "Cannot connect" in text:
            raise _unreachable(address, exc) from None
        if "does not exist" in text or "404" in text:
            raise JobNotFound(f"the Ray head at {address} knows no job {what.rsplit(' ', 1)[-1]}") from None
        raise FtlaunchError(f"Ray refused to {what}: {text}") from None


def submit(
    address: str,
    submission_id: str,
    entrypoint: str,
    env_vars: Mapping[str, str],
    *,
    num_cpus: float | None = None,
    num_gpus: float | None = None,
    metadata: Mapping[str, str] | None = None,
) -> str:
    """Submit one attempt as a job; its submission id is never reused (Ray refuses a second use)."""
    client = _client(address)
    return _call(
        address,
        f"submit job {submission_id}",
        client.submit_job,
        entrypoint=entrypoint,
        submission_id=submission_id,
        runtime_env={"env_vars": dict(env_vars)},
        entrypoint_num_cpus=num_cpus,
        entrypoint_num_gpus=num_gpus,
        metadata=dict(metadata or {}),
    )


@dataclass(frozen=True)
class JobInfo:
    """What the Jobs API says of one submission: its status word, message and the driver's exit code."""

    status: str
    message: str | None = None
    driver_exit_code: int | None = None
    start_time: float | None = None  # epoch seconds
    end_time: float | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


def job(address: str, submission_id: str) -> JobInfo:
    client = _client(address)
    info = _call(address, f"read job {submission_id}", client.get_job_info, submission_id)
    ms = 1000.0
    return JobInfo(
        status=str(getattr(info.status, "value", info.status)),
        message=info.message,
        driver_exit_code=info.driver_exit_code,
        start_time=info.start_time / ms if info.start_time else None,
        end_time=info.end_time / ms if info.end_time else None,
    )


def logs(address: str, submission_id: str) -> str:
    client = _client(address)
    return _call(address, f"read the logs of job {submission_id}", client.get_job_logs, submission_id)


def stop(address: str, submission_id: str) -> bool:
    """Ask Ray to stop the job (SIGTERM to the driver and its processes, SIGKILL after
    RAY_JOB_STOP_WAIT_TIME_S of the head's environment, 3 s by default). False: it had ended."""
    client = _client(address)
    return bool(_call(address, f"stop job {submission_id}", client.stop_job, submission_id))
