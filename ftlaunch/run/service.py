"""Use cases that tie the pure core to the shells: plan a config, create/start/stop/resume runs.

The CLI calls these and only renders; tests call them directly with an env dict and tmp dirs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import IO, Any

from ftlaunch.cli.render import plan_text, to_json
from ftlaunch.errors import BusyError, ConfigError, HardwareError, StateError, StateVersionError
from ftlaunch.plan.config import (
    PATH_KEYS,
    LoadedConfig,
    dump_yaml,
    load_config,
    load_deepspeed,
    redact_secret_text,
    resolve_paths,
    split_secrets,
)
from ftlaunch.plan.hardware import Hardware, catalog_hardware, gpu_memory_of, load_hardware_file, probe
from ftlaunch.plan.memory_store import config_key, recall
from ftlaunch.plan.planner import Plan, PlanOptions, plan
from ftlaunch.run import progress as prog
from ftlaunch.run.procs import Liveness, liveness, spawn_detached, terminate_group
from ftlaunch.run.store import (
    STATE_VERSION,
    RunStatus,
    append_event,
    find_run,
    new_run_id,
    now_iso,
    read_events,
    read_state,
    runs_root,
    update_state,
    write_json_atomic,
    write_secrets,
)
from ftlaunch.run.trainer import find_trainer, public_env


@dataclass(frozen=True)
class PlanRequest:
    config: str
    overrides: tuple[str, ...] = ()
    gpu: str | None = None
    hardware_file: str | None = None
    source_gpus: int | None = None
    global_batch: int | None = None
    headroom: float = 0.12
    params: str | None = None
    model_config: str | None = None
    host_ram_gib: float | None = None  # host RAM to plan offload with; default: the probed machine's
    strict_files: bool = False  # train: a missing dataset is an error, plan: a warning
    mirror: str | None = None  # download from the hub first: None = no, "auto" or a name/URL
    download_weights: bool = False  # train: the whole snapshot; plan: config.json only
    cwd: str | None = None


def get_hardware(req: PlanRequest, env: Mapping[str, str], disk_path: str | Path = ".") -> Hardware:
    if req.gpu and req.hardware_file:
        raise HardwareError("--gpu and --hardware both given", hint="use one of them")
    if req.gpu:
        # A what-if for another machine never counts this machine's RAM (memplan.host_ram_for assumes).
        return catalog_hardware(req.gpu, host_ram_gib=req.host_ram_gib)
    if req.hardware_file:
        try:
            hw = load_hardware_file(req.hardware_file)
        except (AttributeError, TypeError, KeyError, ValueError) as exc:  # valid JSON of the wrong shape
            raise HardwareError(
                f"hardware file {req.hardware_file} does not describe a machine ({type(exc).__name__}: {exc})",
                hint="write it with `ftlaunch env --json > hw.json`",
            ) from None
    else:
        hw = probe(env, disk_path=disk_path)
    if req.host_ram_gib:
        hw = replace(hw, host_ram_gib=req.host_ram_gib, host_available_gib=req.host_ram_gib)
    return hw


def make_plan(req: PlanRequest, env: Mapping[str, str]) -> tuple[LoadedConfig, Plan]:
    loaded = load_config(req.config, req.overrides, cwd=req.cwd)
    values, problems, warnings = resolve_paths(loaded.values, loaded.base_dir, strict=req.strict_files)
    ds = None
    if not problems:
        try:
            ds = load_deepspeed(values)
        except ConfigError as exc:
            problems += exc.problems
    if problems:
        raise ConfigError(problems)
    fetched: Prefetch | None = None
    hub_id = values.get("model_name_or_path")
    if req.mirror and is_hub_id(hub_id):
        fetched = prefetch_model(
            str(hub_id), req.mirror, env, config_only=not req.download_weights, progress=sys.stderr.isatty()
        )
    datasets = None
    if req.mirror and req.download_weights:  # train: hub datasets too, so the offline trainer finds them
        from ftlaunch.hub.datasets import prefetch_datasets

        datasets = prefetch_datasets(values, req.mirror, env, cwd=loaded.base_dir, progress=sys.stderr.isatty())
    hw = get_hardware(req, env, disk_path=values.get("output_dir") or ".")
    g_source = req.global_batch
    from ftlaunch.plan.memplan import make_memory_chooser, model_spec_for

    model_config = req.model_config
    if fetched is not None and model_config is None and (Path(fetched.path) / "config.json").exists():
        model_config = str(Path(fetched.path) / "config.json")
    spec, spec_note = model_spec_for(values, req.params, model_config)
    if spec_note:
        warnings.append(spec_note)
    chooser = make_memory_chooser(spec, ds, headroom=req.headroom) if spec is not None else None
    options = PlanOptions(source_gpus=req.source_gpus, global_batch=g_source, headroom=req.headroom)
    p = plan(values, hw, options, meta=loaded.meta, memory_chooser=chooser)
    # What worked on this card before (learned from a recovered run) wins over the first guess.
    key = config_key(loaded.values, hw.gpu_model, p.global_batch_target)
    learned = recall(env, key)
    if chooser is not None and learned and learned.get("observed"):
        # A run of this config on this card used more than predicted: plan with the correction.
        chooser = make_memory_chooser(spec, ds, headroom=req.headroom, observed=learned["observed"])
        p = plan(values, hw, options, meta=loaded.meta, memory_chooser=chooser)
    if learned and learned.get("micro_batch") and learned["micro_batch"] != p.micro_batch:
        options = PlanOptions(
            source_gpus=req.source_gpus,
            global_batch=g_source,
            headroom=req.headroom,
            remembered_micro_batch=int(learned["micro_batch"]),
            remembered_reason=f"micro-batch {learned['micro_batch']} worked on {hw.gpu_model} "
            f"after an OOM ({learned.get('learned_from')})",
        )
        p = plan(values, hw, options, meta=loaded.meta, memory_chooser=None)
    resolved = [k for k in PATH_KEYS if k in values and loaded.values.get(k) != values.get(k)]
    if resolved:
        p = Plan(**{**p.__dict__, "extra": {**dict(p.extra), "resolved_paths": resolved}})
    if fetched is not None:
        p = with_prefetch(p, fetched, weights=req.download_weights)
    if datasets is not None:
        from ftlaunch.hub.datasets import with_datasets

        p = with_datasets(p, datasets)
    if warnings:
        p = Plan(**{**p.__dict__, "warnings": tuple(warnings) + p.warnings})
    return loaded, p


def with_prefetch(p: Plan, fetched: Prefetch, *, weights: bool) -> Plan:
    """Point the trainer at the local snapshot and keep it off the network (train only)."""
    extra = {"hub": fetched.to_dict()}
    if not weights:
        return Plan(**{**p.__dict__, "extra": {**dict(p.extra), **extra}})
    from ftlaunch.plan.planner import Change

    config = dict(p.config)
    old = config.get("model_name_or_path")
    config["model_name_or_path"] = fetched.path
    why = (
        f"pre-downloaded from {fetched.endpoint or 'ModelScope'} ({fetched.endpoint_reason}); "
        "the trainer then runs with HF_HUB_OFFLINE=1"
    )
    changes = (*p.changes, Change("model_name_or_path", old, fetched.path, why))
    env = {**p.env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return Plan(**{**p.__dict__, "config": config, "changes": changes, "env": env, "extra": {**dict(p.extra), **extra}})


# ---------------------------------------------------------------- runs


def create_run(
    loaded: LoadedConfig,
    p: Plan,
    env: Mapping[str, str],
    *,
    name: str | None = None,
    recover: bool = True,
    max_retries: int = 4,
    max_crash_retries: int = 2,
    trainer_env: Mapping[str, str] | None = None,
    extra_state: Mapping[str, Any] | None = None,
    on_diverge: str = "rollback",
) -> Path:
    """Write a run directory completely, then make it visible with one rename (no half runs).

    Secret-looking keys (hub_token, *_token, *api_key*) go to a 0600 secrets.json only: config.yaml,
    plan.json, plan.txt, source.yaml and state.json never hold them in clear."""
    root = runs_root(env)
    home_problem(env)
    root.mkdir(parents=True, exist_ok=True)
    run_id = new_run_id()
    public, secrets = split_secrets(p.config)
    p = Plan(**{**p.__dict__, "config": public})
    tmp = root / f".{run_id}.tmp"
    tmp.mkdir()
    try:
        from ftlaunch.hub.datasets import INFO_FILE, bind_run_dir

        # Pre-downloaded hub datasets: the run's own dataset_info.json, named by its final path.
        p, dataset_info = bind_run_dir(p, root / run_id)
        if dataset_info is not None:
            (tmp / INFO_FILE).write_text(json.dumps(dataset_info, indent=2, ensure_ascii=False) + "\n")
        source_secrets = split_secrets(loaded.values)[1]
        (tmp / "source.yaml").write_bytes(
            redact_secret_text(loaded.source_path.read_bytes().decode(errors="replace"), source_secrets).encode()
        )
        write_secrets(tmp, secrets)
        (tmp / "config.yaml").write_text(dump_yaml(p.config, p.header))
        (tmp / "plan.txt").write_text(plan_text(p))
        plan_dict = p.to_dict()
        plan_dict["env"] = public_env(p.env)
        (tmp / "plan.json").write_text(to_json(plan_dict))
        (tmp / "hardware.json").write_text(to_json(p.hardware.to_dict()))
        (tmp / "train.log").touch()
        output_dir = str(p.config.get("output_dir", ""))
        state = {
            "version": STATE_VERSION,
            "id": run_id,
            "name": name or Path(output_dir).name or run_id,
            "status": RunStatus.STARTING.value,
            "created": now_iso(),
            "attempt": 0,
            "source_config": str(loaded.source_path),
            "overrides": [redact_secret_text(o, secrets) for o in loaded.overrides],
            "base_dir": str(loaded.base_dir),
            "output_dir": output_dir,
            "run_dir": str(root / run_id),
            "gpu_model": p.hardware.gpu_model,
            "gpu_count": p.hardware.gpu_count,
            "world_size": p.world_size,
            "global_batch": p.global_batch_target,
            "micro_batch": p.micro_batch,
            "accumulation": p.accumulation,
            "recover": recover,
            "on_diverge": on_diverge,  # numeric health policy (ftlaunch.run.health)
            "budget": {"oom_max": max_retries, "crash_max": max_crash_retries, "oom_used": 0, "crash_used": 0},
            "trainer_env": dict(public_env({**p.env, **(trainer_env or {})})),
            "memory_key": config_key(loaded.values, p.hardware.gpu_model, p.global_batch_target),
            "predicted_peak_gib": (p.memory or {}).get("peak_gib") if p.hardware.gpus else None,
            **dict(extra_state or {}),
        }
        write_json_atomic(tmp / "state.json", state)
        (tmp / "events.jsonl").write_text("")
        os.replace(tmp, root / run_id)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    run_dir = root / run_id
    append_event(run_dir, "created", name=state["name"], changes=len(p.changes))
    return run_dir


# ---------------------------------------------------------------- output_dir ownership


class Existing(StrEnum):
    """What `train` may do with checkpoints it finds in the output_dir."""

    REFUSE = "refuse"  # default: only an unfinished ftlaunch run of this config may be continued
    RESUME = "resume"  # --resume-existing: continue them, recorded as such
    FRESH = "fresh"  # --fresh: move the old content aside into <output_dir>.old-<UTC>


def output_dir_verdict(
    output_dir: str, checkpoints: list[str], owners: list[dict[str, Any]], key: str, mode: Existing
) -> tuple[str, str]:
    """Pure: what a new run does with an output_dir: ("use" | "continue" | "adopt" | "fresh", why).

    ``owners``: the states of earlier ftlaunch runs into this output_dir, latest last. Raises
    BusyError (exit 7) for checkpoints that no unfinished ftlaunch run of this config left: the
    trainer would resume them (overwrite_output_dir is off so ftlaunch's restarts resume), and a
    fresh run would silently train nothing, or on top of another run."""
    if mode is Existing.FRESH:
        return "fresh", "--fresh: the old content is moved aside"
    if not checkpoints:
        return "use", "no checkpoints there"
    if mode is Existing.RESUME:
        return "adopt", f"--resume-existing: continuing {checkpoints[-1]}"
    mine = owners[-1] if owners else None
    if mine and mine.get("memory_key") == key and mine.get("status") != RunStatus.SUCCEEDED.value:
        return "continue", f"continuing run {mine.get('id')} of this config from {checkpoints[-1]}"
    if mine and mine.get("memory_key") == key:
        why = f"run {mine.get('id')} of this config already succeeded there"
    elif mine:
        why = f"run {mine.get('id')} of another config left them"
    else:
        why = "no ftlaunch run left them"
    raise BusyError(
        f"output_dir {output_dir} holds {', '.join(checkpoints[-3:])}"
        f"{' ...' if len(checkpoints) > 3 else ''}: {why}; the trainer would resume from them",
        hint="pass --resume-existing to continue those checkpoints, --fresh to move them aside into "
        f"{output_dir}.old-<UTC time> (nothing is deleted), or set another output_dir",
    )


def home_problem(env: Mapping[str, str]) -> None:
    """FTLAUNCH_HOME must be a directory this user can write (exit 12, like `schedule add`)."""
    root = runs_root(env)
    if problem := not_writable(root):
        raise StateError(f"FTLAUNCH_HOME: {problem}", hint="set FTLAUNCH_HOME to a writable directory")


def not_writable(path: Path) -> str | None:
    """Why files cannot be created in ``path`` (made if missing), or None. A real probe: os.access
    says yes to root on a read-only mount."""
    import tempfile

    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        return f"{path} is not writable ({exc.strerror or exc})"
    return None


def claim_output_dir(
    env: Mapping[str, str], loaded: LoadedConfig, p: Plan, existing: Existing = Existing.REFUSE
) -> tuple[IO[str], dict[str, Any]]:
    """Before a new run exists: check FTLAUNCH_HOME and the output_dir, take the output_dir's lock
    (exit 7 when a live run holds it) and decide about old checkpoints under it.

    Returns the held lock (hand it to `start_detached` or the Supervisor) and the state fields that
    record what was found."""
    from ftlaunch.plan.memory_store import config_key
    from ftlaunch.run.store import list_runs
    from ftlaunch.run.supervisor import NEW_RUN, acquire_output_lock

    home_problem(env)
    output_dir = str(p.config.get("output_dir") or "")
    if not output_dir:
        raise ConfigError("key 'output_dir' is missing: the run needs a directory for its checkpoints")
    if problem := not_writable(Path(output_dir)):
        raise ConfigError(f"output_dir {problem}", hint="choose a directory you can write")
    lock = acquire_output_lock(env, output_dir, f"{NEW_RUN} (pid {os.getpid()})")
    try:
        out = Path(output_dir)
        checkpoints = [path.name for _, path in prog.checkpoint_dirs(out)]
        owners = []
        for run_dir in list_runs(env):
            try:
                st = read_state(run_dir)
            except StateError:
                continue
            if st.get("output_dir") and os.path.abspath(st["output_dir"]) == os.path.abspath(output_dir):
                owners.append(st)
        owners.sort(key=lambda st: str(st.get("created") or ""))  # ids of one second sort at random
        key = config_key(loaded.values, p.hardware.gpu_model, p.global_batch_target)
        verdict, why = output_dir_verdict(output_dir, checkpoints, owners, key, existing)
        record: dict[str, Any] = {}
        if verdict == "fresh" and out.is_dir() and any(out.iterdir()):
            aside = Path(f"{output_dir}.old-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
            out.rename(aside)
            out.mkdir()
            record = {"output_dir_moved_to": str(aside)}
        elif verdict in ("adopt", "continue"):
            record = {"adopted_checkpoint": checkpoints[-1], "adopted_because": why}
        return lock, record
    except BaseException:
        lock.close()
        raise


def new_run(
    loaded: LoadedConfig, p: Plan, env: Mapping[str, str], *, existing: Existing = Existing.REFUSE, **settings: Any
) -> tuple[Path, IO[str]]:
    """`train`: claim the output_dir, then create the run. The lock returned is held: pass it on to
    `start_detached` or `Supervisor(lock=...)`, so no second run can start in between."""
    from ftlaunch.run.supervisor import relabel_lock

    lock, record = claim_output_dir(env, loaded, p, existing)
    try:
        extra = {**dict(settings.pop("extra_state", None) or {}), **record}
        run_dir = create_run(loaded, p, env, extra_state=extra, **settings)
        relabel_lock(lock, run_dir.name)
        if record:
            append_event(run_dir, "output_dir_claimed", **record)
    except BaseException:
        lock.close()
        raise
    return run_dir, lock


def supervisor_command(run_dir: Path, lock_fd: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "ftlaunch.run.supervisor", str(run_dir)]
    return cmd if lock_fd is None else [*cmd, "--lock-fd", str(lock_fd)]


def start_detached(run_dir: Path, env: Mapping[str, str], wait: float = 60.0, lock: IO[str] | None = None) -> int:
    """Spawn the supervisor in a new session; return its pid once it has taken over the run.

    ``lock``: the output_dir lock this process holds; the supervisor inherits it (same open file,
    so the lock never lapses) and this process lets go of its copy. Without it, a supervisor that
    finds the output_dir busy exits 7, and so does this call."""
    try:
        find_trainer(env)  # fail now, in the user's shell, rather than in the background
        fd = lock.fileno() if lock is not None else None
        proc = spawn_detached(
            supervisor_command(run_dir, fd), env, run_dir / "supervisor.log", cwd=run_dir, pass_fds=(fd,) if fd else ()
        )
    finally:
        if lock is not None:
            lock.close()
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            st = read_state(run_dir)
        except StateError:
            st = {}
        if st.get("pid") == proc.pid:
            break
        if proc.poll() is not None:
            if proc.returncode == 0:
                break  # already done (a finished run)
            tail = (run_dir / "supervisor.log").read_text(errors="replace").strip().splitlines()[-1:]
            why = tail[0] if tail else f"exit {proc.returncode}"
            if proc.returncode == int(BusyError.exit_code):
                raise BusyError(why.removeprefix("ftlaunch supervisor: "))
            raise StateError(f"the supervisor of run {run_dir.name} did not start: {why}")
        time.sleep(0.05)
    return proc.pid


# ---------------------------------------------------------------- status


def run_view(run_dir: Path, now: float | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One run as `status --json` shows it. Liveness decides running vs lost (fails closed); for a
    Slurm run, Slurm decides (its supervisor runs on another host: queued, starting, or the state)."""
    state = read_state(run_dir)
    status = RunStatus(state.get("status", "lost"))
    live = liveness(state.get("pid"), state.get("pid_start"))
    trainer_live = liveness(state.get("trainer_pid"), state.get("trainer_start"))
    slurm_state = None
    if state.get("slurm_job_id"):
        status, slurm_state = _slurm_status(state, status, live, os.environ if env is None else env)
    elif not status.is_terminal() and live is Liveness.DEAD:
        status = RunStatus.LOST
    p = state.get("progress") or {}
    step, total = p.get("step"), p.get("total_steps")
    gpu_gib = None
    if trainer_live is Liveness.ALIVE and state.get("gpu_count"):
        gpu_gib = gpu_memory_of(_process_tree(int(state["trainer_pid"])))
    rate = state.get("steps_per_second")
    eta = None
    if status in (RunStatus.RUNNING, RunStatus.RECOVERING) and rate and step is not None and total:
        since = (now or time.time()) - float(state.get("progress_at") or time.time())
        eta = max(0.0, (total - step) / rate - since)
    cost = _cost(run_dir, state, status, step, total, rate, now)
    return {
        "id": state.get("id", run_dir.name),
        "name": state.get("name"),
        "status": status.value,
        "attempt": state.get("attempt"),
        "step": step,
        "total_steps": total,
        "loss": p.get("loss"),
        "lr": p.get("lr"),
        "throughput": p.get("throughput"),
        "steps_per_second": rate,
        "eta_seconds": None if eta is None else round(eta, 1),
        "micro_batch": state.get("micro_batch"),
        "accumulation": state.get("accumulation"),
        "pid": state.get("pid"),
        "supervisor_alive": live.value,
        "trainer_pid": state.get("trainer_pid"),
        "trainer_alive": trainer_live.value,
        "output_dir": state.get("output_dir"),
        "run_dir": str(run_dir),
        "created": state.get("created"),
        "exit_code": state.get("exit_code"),
        "failure_kind": state.get("failure_kind"),
        "message": state.get("message"),
        "last_checkpoint": state.get("last_checkpoint"),
        # numeric health of the current attempt (finite/spiky/diverged) and the last divergence seen
        "health": (state.get("health") or {}).get("health"),
        "diverged": state.get("diverged"),
        "gpu_memory_gib": gpu_gib,
        "predicted_peak_gib": state.get("predicted_peak_gib"),
        "observed_peak_gib": state.get("observed_peak_gib"),
        "slurm_job_id": state.get("slurm_job_id"),
        "slurm_state": slurm_state,
        **cost,
    }


def _slurm_status(
    state: Mapping[str, Any], recorded: RunStatus, live: Liveness, env: Mapping[str, str]
) -> tuple[RunStatus, str | None]:
    """A Slurm run: queued/starting while Slurm holds the job and no supervisor has taken over;
    the supervisor's own status while the job runs; lost if the job ended without a final status."""
    from ftlaunch.run.slurm import sbatch as slurm

    job_state = slurm.job_state(str(state["slurm_job_id"]), env)
    if job_state in slurm.ACTIVE_STATES:
        if recorded in (RunStatus.RUNNING, RunStatus.RECOVERING) and job_state not in slurm.QUEUED_STATES:
            return recorded, job_state
        return RunStatus(slurm.status_of(job_state) or recorded.value), job_state
    if recorded.is_terminal() or live is not Liveness.DEAD:
        return recorded, job_state
    if job_state == "CANCELLED":
        return RunStatus.STOPPED, job_state
    return RunStatus.LOST, job_state


def _cost(run_dir: Path, state: dict, status: RunStatus, step, total, rate, now) -> dict[str, Any]:
    """tokens/s of this attempt and GPU-hours so far / projected, from the run's own records."""
    from ftlaunch.estimate import core as est

    gpus = int(state.get("gpu_count") or 0)
    live = status in (RunStatus.RUNNING, RunStatus.RECOVERING, RunStatus.STARTING)
    # A lost run's last attempt ended at its last sign of life, not at 0 s (nor now).
    end = (now or time.time()) if live else _last_sign_of_life(run_dir, state)
    spans = est.attempt_spans(read_events(run_dir), now=end)
    busy = est.busy_seconds(spans)
    so_far = est.gpu_hours(busy, gpus)
    left = est.projected_hours(step, total, rate) if live else 0.0
    tokens_per_second = None
    out_dir = Path(state.get("output_dir") or "")
    if live and (out_dir / "trainer_log.jsonl").exists():
        records = prog.parse_trainer_log((out_dir / "trainer_log.jsonl").read_text(errors="replace"))
        tokens_per_second = est.recent_rates(records).get("tokens_per_second")
    return {
        "tokens_per_second": tokens_per_second,
        "wall_seconds": round(busy, 1),
        "gpu_hours": round(so_far, 4),
        "gpu_hours_projected": None if left is None else round(so_far + left * gpus, 4),
    }


def _last_sign_of_life(run_dir: Path, state: Mapping[str, Any]) -> float | None:
    """When a run last wrote anything: its log, events, state, or the trainer's log."""
    paths = [run_dir / n for n in ("train.log", "events.jsonl", "state.json")]
    if state.get("output_dir"):
        paths.append(Path(str(state["output_dir"])) / "trainer_log.jsonl")
    times = []
    for p in paths:
        try:
            times.append(p.stat().st_mtime)
        except OSError:
            continue
    return max(times, default=None)


def _process_tree(pid: int) -> set[int]:
    import psutil

    try:
        proc = psutil.Process(pid)
        return {pid, *(c.pid for c in proc.children(recursive=True))}
    except psutil.Error:
        return {pid}


def _stop_slurm_job(run_dir: Path, job: str, grace: float) -> str | None:
    """scancel a Slurm run's job while Slurm holds it: its batch step stops the supervisor, which
    stops the trainer gracefully. None when the job is over (then stop as any run)."""
    from ftlaunch.run.slurm import sbatch as slurm

    job_state = slurm.job_state(job, os.environ)
    if job_state not in slurm.ACTIVE_STATES:
        return None
    slurm.cancel(job, os.environ)
    append_event(run_dir, "scancel", job_id=job, slurm_state=job_state)
    if job_state in slurm.QUEUED_STATES:
        update_state(run_dir, status=RunStatus.STOPPED.value, ended=time.time(), message="cancelled while queued")
        return f"run {run_dir.name}: Slurm job {job} cancelled while {job_state.lower()}"
    deadline = time.monotonic() + grace + 30
    while time.monotonic() < deadline:
        if RunStatus(_state_or_empty(run_dir).get("status", "lost")).is_terminal():
            return f"run {run_dir.name} stopped (Slurm job {job} cancelled)"
        time.sleep(0.2)
    return f"run {run_dir.name}: Slurm job {job} cancelled; its supervisor has not recorded the stop yet"


def stop_run(run_dir: Path, grace: float = 30.0, env: Mapping[str, str] | None = None) -> str:
    """SIGTERM the supervisor (it stops the trainer's group once and records it); clean up if it is gone.

    Liveness decides, and a live supervisor is always the one told: a trainer signalled behind its
    supervisor's back would count as a crash and be restarted."""
    state = _wait_while_starting(run_dir, read_state(run_dir), os.environ if env is None else env)
    if state.get("slurm_job_id"):
        said = _stop_slurm_job(run_dir, str(state["slurm_job_id"]), grace)
        if said:
            return said
    status = RunStatus(state.get("status", "lost"))
    pid, started = state.get("pid"), state.get("pid_start")
    live = liveness(pid, started)
    if status.is_terminal() and (live is not Liveness.DEAD or state.get("trainer_pid") is None):
        # A terminal status is the supervisor's last write: nothing of the run is left to stop
        # (a foreground supervisor's process may live on; it is not ours to signal).
        return f"run {run_dir.name} already {status.value}"
    if live is Liveness.UNKNOWN:
        return f"run {run_dir.name}: cannot tell whether pid {pid} is ours; not touching it"
    if live is Liveness.ALIVE:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace + 10
        while liveness(pid, started) is Liveness.ALIVE:
            if RunStatus(_state_or_empty(run_dir).get("status", "lost")).is_terminal():
                return f"run {run_dir.name} stopped"
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.1)
    # The supervisor is gone; its trainer may be an orphan still holding the GPU.
    if liveness(state.get("trainer_pid"), state.get("trainer_start")) is Liveness.ALIVE:
        terminate_group(state["trainer_pid"], grace=grace)
    if not RunStatus(_state_or_empty(run_dir).get("status", "lost")).is_terminal():
        update_state(run_dir, status=RunStatus.STOPPED.value, ended=time.time(), message="stopped by the user")
        append_event(run_dir, "stopped", message="supervisor was gone; trainer stopped directly")
    return f"run {run_dir.name} stopped"


def _wait_while_starting(run_dir: Path, state: dict[str, Any], env: Mapping[str, str], wait: float = 60.0) -> dict:
    """A run whose starter holds its output_dir lock but whose supervisor has not written its pid yet
    (between `train`/`resume` and "started"): wait for the pid, so the stop reaches the supervisor
    instead of being recorded and then overwritten by it."""
    from ftlaunch.run.supervisor import OutputDirBusy, acquire_output_lock

    deadline = time.monotonic() + wait
    while state.get("status") == RunStatus.STARTING.value and not state.get("pid") and time.monotonic() < deadline:
        try:
            acquire_output_lock(env, str(state.get("output_dir") or ""), "stop").close()
            return state  # nobody is starting it
        except OutputDirBusy:
            time.sleep(0.1)
            state = _state_or_empty(run_dir) or state
    return state


def _state_or_empty(run_dir: Path) -> dict[str, Any]:
    try:
        return read_state(run_dir)
    except StateError:
        return {}


def resolve_run(env: Mapping[str, str], ref: str | None) -> Path:
    return find_run(env, ref)


def resume_run(
    run_dir: Path,
    env: Mapping[str, str],
    *,
    foreground: bool = False,
    overrides: tuple[str, ...] = (),
    allow_global_batch_change: bool = False,
) -> tuple[str, int]:
    """Re-attach if alive; restart from the last complete checkpoint if the run died.

    ``overrides`` (key=value) edit the run's adapted config first; refused while the run is alive.
    The restart happens under the output_dir lock, taken before any state changes and handed to
    the new supervisor: of two concurrent resumes one restarts the run, the other exits 7 (or
    re-attaches) and touches nothing."""
    from ftlaunch.run.supervisor import OutputDirBusy, Supervisor, acquire_output_lock

    try:
        state = read_state(run_dir)
    except StateVersionError:
        raise  # another ftlaunch's state: not ours to rebuild over
    except StateError:
        state = rebuild_state(run_dir)
    verdict = _resume_verdict(run_dir, state, overrides)
    if verdict is not None:
        return verdict
    output_dir = str(state.get("output_dir") or "")
    try:
        lock = acquire_output_lock(env, output_dir, run_dir.name)
    except OutputDirBusy as exc:
        if exc.holder == run_dir.name:
            raise BusyError(
                f"run {run_dir.name} is being started by another process right now",
                hint=f"`ftlaunch status {run_dir.name}` shows it in a moment",
            ) from None
        raise
    try:
        state = read_state(run_dir)  # again, under the lock: another resume may have come first
        verdict = _resume_verdict(run_dir, state, overrides)
        if verdict is not None:
            return verdict
        status = RunStatus(state.get("status", "lost"))
        if liveness(state.get("trainer_pid"), state.get("trainer_start")) is not Liveness.DEAD:
            terminate_group(state["trainer_pid"], grace=30)  # an orphan from a killed supervisor
        if overrides:
            edit_run_config(run_dir, overrides, allow_global_batch_change=allow_global_batch_change)
        out = Path(state.get("output_dir") or "")
        last = prog.last_complete_checkpoint(out)
        if overrides and last is not None:
            _rewrite_checkpoint_lr(run_dir, env, out, last[1].name, overrides)
        # A run that gave up gets a fresh budget: the user changed something, or wants another go.
        b = dict(state.get("budget") or {})
        b.update({"oom_used": 0, "crash_used": 0, "tried": []})
        update_state(run_dir, status=RunStatus.STARTING.value, budget=b, pid=None, trainer_pid=None)
        append_event(run_dir, "resumed", previous=status.value, from_checkpoint=last[1].name if last else None)
    except BaseException:
        lock.close()
        raise
    if foreground:
        return "foreground", Supervisor(run_dir, env, echo=True, lock=lock).run()
    return "restarted", start_detached(run_dir, env, lock=lock)


def _rewrite_checkpoint_lr(
    run_dir: Path, env: Mapping[str, str], out: Path, checkpoint: str, overrides: tuple[str, ...]
) -> None:
    """`resume RUN learning_rate=X`: llamafactory restores the lr from the checkpoint's optimizer.pt
    and scheduler.pt on resume (a new YAML value is silently ignored), so write it there too; the
    original checkpoint is kept as rolledback-<name>-<time> (weights hard-linked)."""
    from ftlaunch.plan.config import parse_overrides
    from ftlaunch.run import rollback

    lr = parse_overrides(overrides)[0].get("learning_rate")
    if lr is None:
        return
    err = rollback.scale_lr(out, checkpoint, float(lr), rollback.python_of(find_trainer(env)[0]), rollback.now_stamp())
    append_event(run_dir, "checkpoint_lr_rewritten", checkpoint=checkpoint, learning_rate=float(lr), error=err)
    if err:
        raise ConfigError(
            f"learning_rate={lr} could not be written into {checkpoint} (a resume restores the old lr from it): {err}",
            hint="resume without the learning_rate override, or start afresh with --fresh",
        )


def _resume_verdict(run_dir: Path, state: dict[str, Any], overrides: tuple[str, ...]) -> tuple[str, int] | None:
    """("alive", pid) or ("finished", 0) when there is nothing to restart; None to restart."""
    status = RunStatus(state.get("status", "lost"))
    live = liveness(state.get("pid"), state.get("pid_start"))
    # A terminal status is written by the supervisor as its last act: its pid no longer matters
    # (a foreground run's "supervisor" was the ftlaunch process itself, which may live on).
    if not status.is_terminal() and live in (Liveness.ALIVE, Liveness.UNKNOWN):
        if overrides:
            raise BusyError(
                f"run {run_dir.name} is alive: its config cannot change under it",
                hint=f"stop it first (`ftlaunch stop {run_dir.name}`), then resume with the change",
            )
        return "alive", int(state.get("pid") or 0)
    if status is RunStatus.SUCCEEDED:
        return "finished", 0
    return None


def global_batch_change(
    config: Mapping[str, Any], values: Mapping[str, Any], world_size: int
) -> tuple[int, int] | None:
    """Pure: (before, after) when ``values`` change micro-batch x accumulation x world size."""

    def g(c: Mapping[str, Any]) -> int:
        return (
            int(c.get("per_device_train_batch_size") or 1) * int(c.get("gradient_accumulation_steps") or 1) * world_size
        )

    before, after = g(config), g({**config, **values})
    return (before, after) if before != after else None


def preview_run_edit(run_dir: Path, overrides: tuple[str, ...]) -> list[tuple[str, Any, Any, str]]:
    """What `resume RUN key=value` would change: (key, before, after, note) rows, the global batch
    included when it moves. Validates like any config (ConfigError, exit 3)."""
    import yaml

    from ftlaunch.plan.config import is_secret_key, parse_overrides, validate_keys, validate_values

    values, problems = parse_overrides(overrides)
    problems += validate_keys(values) + validate_values(values)
    if problems:
        raise ConfigError(problems)
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    rows = [
        (k, "***" if is_secret_key(k) else config.get(k), "***" if is_secret_key(k) else v, "")
        for k, v in values.items()
    ]
    world = int(_state_or_empty(run_dir).get("world_size") or 1)
    if moved := global_batch_change(config, values, world):
        rows.append(("global batch", moved[0], moved[1], "micro-batch x accumulation x world size"))
    return rows


def edit_run_config(
    run_dir: Path, overrides: tuple[str, ...], *, allow_global_batch_change: bool = False
) -> dict[str, Any]:
    """Apply key=value overrides to a run's adapted config (validated; written atomically).

    A change of the global batch is refused (exit 3) unless allowed: it changes what is trained."""
    import yaml

    from ftlaunch.plan.config import parse_overrides, read_header
    from ftlaunch.run.store import read_secrets, write_text_atomic

    rows = preview_run_edit(run_dir, overrides)
    moved = [r for r in rows if r[0] == "global batch"]
    if moved and not allow_global_batch_change:
        _, before, after, _ = moved[0]
        raise ConfigError(
            f"these overrides change the global batch from {before} to {after}",
            hint="pass --allow-global-batch-change to accept that, or keep micro-batch x accumulation at "
            f"{before} (e.g. set gradient_accumulation_steps too)",
        )
    values = parse_overrides(overrides)[0]
    public, secrets = split_secrets(values)
    write_secrets(run_dir, {**read_secrets(run_dir), **secrets})
    text = (run_dir / "config.yaml").read_text()
    config = yaml.safe_load(text) or {}
    before = {k: config.get(k) for k in public}
    config.update(public)
    write_text_atomic(run_dir / "config.yaml", dump_yaml(config, read_header(text)))
    append_event(run_dir, "config_edited", before=before, after=public, secrets=sorted(secrets))
    fields: dict[str, Any] = {}
    if "per_device_train_batch_size" in values:
        fields["micro_batch"] = values["per_device_train_batch_size"]
    if "gradient_accumulation_steps" in values:
        fields["accumulation"] = values["gradient_accumulation_steps"]
    if moved:
        fields["global_batch"] = moved[0][2]
    if fields:
        update_state(run_dir, **fields)
    return config


def rebuild_state(run_dir: Path) -> dict[str, Any]:
    """state.json lost or corrupt: rebuild enough of it from config.yaml to resume."""
    import yaml

    cfg_path = run_dir / "config.yaml"
    if not cfg_path.exists():
        raise StateError(f"run {run_dir.name}: neither state.json nor config.yaml is readable")
    values = yaml.safe_load(cfg_path.read_text()) or {}
    bad = run_dir / "state.json"
    if bad.exists():
        bad.rename(run_dir / f"state.json.corrupt-{int(time.time())}")
    state = {
        "version": STATE_VERSION,
        "id": run_dir.name,
        "name": Path(str(values.get("output_dir", run_dir.name))).name,
        "status": RunStatus.LOST.value,
        "attempt": 0,
        "output_dir": values.get("output_dir"),
        "run_dir": str(run_dir),
        "recover": True,
        "rebuilt": now_iso(),
    }
    write_json_atomic(run_dir / "state.json", state)
    append_event(run_dir, "state_rebuilt")
    return state


def all_runs(env: Mapping[str, str]) -> list[dict[str, Any]]:
    from ftlaunch.run.store import list_runs

    out = []
    for run_dir in list_runs(env):
        try:
            out.append(run_view(run_dir))
        except StateError as exc:
            out.append({"id": run_dir.name, "status": "unreadable", "message": exc.message, "run_dir": str(run_dir)})
    return out


# ---------------------------------------------------------------- hub


@dataclass(frozen=True)
class Prefetch:
    repo_id: str
    endpoint: str | None
    endpoint_reason: str
    path: str
    files: int
    bytes: int
    retries: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def is_hub_id(value: Any) -> bool:
    return (
        isinstance(value, str)
        and not Path(value).exists()
        and value.count("/") == 1
        and not value.startswith(("/", ".", "~"))
    )


def prefetch_model(
    repo_id: str,
    mirror: str | None,
    env: Mapping[str, str],
    *,
    revision: str | None = None,
    config_only: bool = False,
    progress: bool = True,
    on_retry: Any = None,
    repo_type: str = "model",
) -> Prefetch:
    """Choose an endpoint and download ``repo_id`` (or just its config.json) into the hub cache."""
    from ftlaunch import hub

    choice = hub.choose_endpoint(repo_id, mirror, env, repo_type=repo_type)
    endpoint = hub.MODELSCOPE if choice.use_modelscope else choice.url
    cache = env.get("HF_HUB_CACHE") or (str(Path(env["HF_HOME"]) / "hub") if env.get("HF_HOME") else None)
    token = env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN") or None
    result = hub.download(
        repo_id,
        endpoint=endpoint or "hf",
        revision=revision,
        cache_dir=cache,
        token=token,
        progress=progress,
        on_retry=on_retry,
        allow_patterns=["config.json"] if config_only else None,
        repo_type=repo_type,
    )
    return Prefetch(repo_id, choice.url, choice.reason, result.path, result.files, result.bytes, result.retries)
