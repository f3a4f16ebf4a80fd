"""Reading and keeping the environment a run trains with (the values are ``ftlaunch.plan.environment``).

The environment is the TRAINER's: the Python llamafactory-cli runs under (its shebang), which may not
be ftlaunch's own. Its distributions are read from that interpreter's site-packages folders, found
from its prefix (pyvenv.cfg, lib/pythonX.Y/site-packages), by reading each dist-info's METADATA
headers and direct_url.json: no subprocess, no import, nothing cached (a `pip install` between two
attempts must show). NVML gives the driver, CUDA and the GPUs when the run plans GPUs.

Each attempt's record is ``<run_dir>/environment/attempt-N.json`` (written atomically). An attempt
compares its environment with the last attempt that trained (the one whose checkpoints it resumes);
the first run of a schedule's later run compares with the schedule's previous run.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ftlaunch.errors import EnvChangedError, ExitCode, FtlaunchError, StateError
from ftlaunch.files import now_iso, write_json_atomic
from ftlaunch.plan.environment import ENV_VERSION, EnvDiff, Environment, canonical, compare, diff_table, lock_text
from ftlaunch.probe.hardware import load_pynvml
from ftlaunch.run import transitions as journal
from ftlaunch.run.events import Event
from ftlaunch.run.state import RunState
from ftlaunch.run.staterecords import EnvironmentRecord
from ftlaunch.run.store import RunFolder, read_state

_ATTEMPT = re.compile(r"attempt-(\d+)\.json$")
ALLOW_HINT = "pass --allow-env-change to resume anyway"


# ---------------------------------------------------------------- reading an interpreter's packages


def trainer_interpreter(env: Mapping[str, str]) -> str:
    """The Python that runs llamafactory-cli (its shebang); ftlaunch's own when it names none."""
    from ftlaunch.run.rollback import python_of
    from ftlaunch.run.trainer import find_trainer

    try:
        return python_of(find_trainer(env)[0])
    except FtlaunchError:
        return sys.executable


def _pyvenv(prefix: Path) -> dict[str, str]:
    try:
        text = (prefix / "pyvenv.cfg").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip().lower()] = value.strip()
    return out


def site_dirs(python: str, env: Mapping[str, str] | None = None) -> tuple[list[Path], str | None]:
    """(the folders the interpreter imports distributions from, in its order; its version).

    From its prefix, for ftlaunch's own interpreter too (its sys.path would depend on the folder it
    was started in), never resolved (a venv's python is a link to the base one): a venv's
    lib/pythonX.Y/site-packages, plus the base interpreter's with include-system-site-packages; a
    plain install's user site, site-packages and Debian's dist-packages."""
    exe = Path(os.path.abspath(python))
    prefix = exe.parent.parent
    cfg = _pyvenv(prefix)
    version = cfg.get("version") or cfg.get("version_info")
    if version is None and prefix == Path(sys.prefix):
        version = platform.python_version()
    found = sorted(prefix.glob("lib/python3.*/site-packages"))
    minor = ".".join(version.split(".")[:2]) if version else None
    if minor is None:
        named = re.search(r"python(3\.\d+)$", exe.name)
        minor = named.group(1) if named else (found[-1].parent.name[len("python") :] if found else None)
    if minor is None:
        return [], version
    dirs = [prefix / "lib" / f"python{minor}" / "site-packages", prefix / "lib64" / f"python{minor}" / "site-packages"]
    if cfg:
        if cfg.get("include-system-site-packages", "false").lower() == "true" and cfg.get("home"):
            base = Path(cfg["home"]).parent
            dirs += [base / "lib" / f"python{minor}" / "site-packages", base / "lib" / "python3" / "dist-packages"]
    else:
        home = (env or {}).get("HOME")
        user = [Path(home) / ".local" / "lib" / f"python{minor}" / "site-packages"] if home else []
        local = [
            prefix / "local" / "lib" / f"python{minor}" / "dist-packages",
            prefix / "lib" / "python3" / "dist-packages",
        ]
        dirs = user + dirs + local
    seen, out = set(), []
    for d in dirs:
        real = os.path.realpath(d)
        if real not in seen and d.is_dir():
            seen.add(real)
            out.append(d)
    return out, version or minor


def _headers(path: Path) -> tuple[str | None, str | None]:
    """(Name, Version) from a METADATA/PKG-INFO file's headers, read only as far as they go."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
            while b"\n\n" not in head and len(head) < 1 << 16:
                more = f.read(4096)
                if not more:
                    break
                head += more
    except OSError:
        return None, None
    name = version = None
    for raw in head.split(b"\n"):
        line = raw.strip(b"\r")
        if not line.strip():
            break
        if line.startswith(b"Name:") and name is None:
            name = line[5:].strip().decode(errors="replace")
        elif line.startswith(b"Version:") and version is None:
            version = line[8:].strip().decode(errors="replace")
        if name and version:
            break
    return name, version


def read_distributions(dirs: Iterable[Path]) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """(canonical name -> version, canonical name -> direct_url.json) of every distribution in
    ``dirs``; the first of a name wins, as on import."""
    packages: dict[str, str] = {}
    sources: dict[str, dict[str, Any]] = {}
    for d in dirs:
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            continue
        for e in entries:
            if e.name.endswith(".dist-info"):
                meta = "METADATA"
            elif e.name.endswith(".egg-info"):
                meta = "PKG-INFO" if e.is_dir() else ""
            else:
                continue
            name, version = _headers(Path(e.path) / meta) if meta else _headers(Path(e.path))
            if not name or not version or canonical(name) in packages:
                continue
            key = canonical(name)
            packages[key] = version
            try:
                with open(Path(e.path) / "direct_url.json", "rb") as f:
                    sources[key] = json.loads(f.read())
            except (OSError, ValueError):
                pass
    return packages, sources


def _torch_cuda(dirs: Iterable[Path]) -> str | None:
    """The CUDA torch was built with, from torch/version.py (read, never imported)."""
    for d in dirs:
        try:
            text = (d / "torch" / "version.py").read_text()
        except OSError:
            continue
        m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
        return m.group(1) if m else None
    return None


def nvml_system(loader: Callable[[], Any] = load_pynvml) -> dict[str, Any]:
    """Driver, CUDA driver API version, NVML version and the GPUs; ``why`` when NVML cannot tell."""

    def text(v: Any) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    try:
        nvml = loader()
        nvml.nvmlInit()
    except Exception as exc:
        return {"why": f"NVML unavailable: {exc}"}
    try:
        cuda = int(nvml.nvmlSystemGetCudaDriverVersion())
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            mib = int(nvml.nvmlDeviceGetMemoryInfo(h).total // 2**20)
            gpus.append(f"{text(nvml.nvmlDeviceGetName(h))} ({mib} MiB)")
        return {
            "driver": text(nvml.nvmlSystemGetDriverVersion()),
            "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}",
            "nvml": text(nvml.nvmlSystemGetNVMLVersion()),
            "gpus": gpus,
        }
    except Exception as exc:
        return {"why": f"NVML failed: {exc}"}
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def read_environment(
    python: str,
    env: Mapping[str, str] | None = None,
    *,
    gpus: bool = True,
    nvml_loader: Callable[[], Any] = load_pynvml,
    attempt: int | None = None,
) -> Environment:
    """The environment of ``python`` now. ``gpus``: ask NVML (False for a run planned on CPUs)."""
    dirs, version = site_dirs(python, env)
    packages, sources = read_distributions(dirs)
    system: dict[str, Any] = nvml_system(nvml_loader) if gpus else {"why": "no GPU planned: NVML not asked"}
    system["torch_cuda"] = _torch_cuda(dirs)
    return Environment(python, version, packages, sources, system, recorded=now_iso(), attempt=attempt)


def trainer_environment(env: Mapping[str, str], *, gpus: bool = True, attempt: int | None = None) -> Environment:
    return read_environment(trainer_interpreter(env), env, gpus=gpus, attempt=attempt)


# ---------------------------------------------------------------- a run's records


def attempt_path(run_dir: Path, attempt: int) -> Path:
    return RunFolder(run_dir).environment_of(attempt)


class UnreadableRecord(StateError):
    """The newest environment record exists but cannot be read as one: empty, torn, not a record, or of
    another format version. The environment that trained is then unknown: never taken as "unchanged"."""


def parse_record(text: str) -> Environment:
    """One attempt-N.json as this ftlaunch writes it; UnreadableRecord (saying why) otherwise."""
    if not text.strip():
        raise UnreadableRecord("it is empty")
    try:
        d = json.loads(text)
    except ValueError as exc:
        raise UnreadableRecord(f"it is torn (not JSON: {exc})") from None
    if not isinstance(d, dict):
        raise UnreadableRecord(f"it is not a record (a JSON {type(d).__name__})")
    if d.get("version") != ENV_VERSION:
        raise UnreadableRecord(f"it is of format version {d.get('version')!r}, this ftlaunch reads {ENV_VERSION}")
    if not isinstance(d.get("packages"), dict):
        raise UnreadableRecord("it has no package list")
    try:
        return Environment.from_json(d)
    except (ValueError, TypeError, AttributeError) as exc:
        raise UnreadableRecord(f"it is not a record ({exc})") from None


def recorded(run_dir: Path, before: int | None = None) -> Environment | None:
    """The last attempt's recorded environment (before attempt ``before``), None when none was kept.
    UnreadableRecord when that newest record is there but unreadable (an older one is not used in its
    place: it may predate a change)."""
    try:
        names = os.listdir(RunFolder(run_dir).environment)
    except OSError:
        return None
    attempts = sorted(int(m.group(1)) for n in names if (m := _ATTEMPT.match(n)))
    for n in reversed([a for a in attempts if before is None or a < before]):
        path = attempt_path(run_dir, n)
        try:
            text = path.read_text(errors="replace")
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise UnreadableRecord(f"environment record {path}: {exc.strerror or exc}") from None
        try:
            return parse_record(text)
        except UnreadableRecord as exc:
            raise UnreadableRecord(f"environment record {path}: {exc.message}") from None
    return None


def write_record(run_dir: Path, environment: Environment) -> Path:
    path = attempt_path(run_dir, int(environment.attempt or 0))
    write_json_atomic(path, environment.to_json())
    return path


def _previous_of_schedule(run_dir: Path, env: Mapping[str, str], schedule: str) -> tuple[str, Environment] | None:
    """The last environment recorded by an earlier run of the same schedule."""
    from ftlaunch.run.orphans import runs_where

    earlier = [d for d, _st in runs_where(env, lambda st: st.schedule == schedule) if d.name != run_dir.name]
    for d in reversed(earlier):
        if (e := recorded(d)) is not None:
            return d.name, e
    return None


def _changed_note(attempt: int, diff: EnvDiff, accepted: bool, since_run: str | None) -> dict[str, Any]:
    return {
        "attempt": attempt,
        "changes": diff.summary(),
        "accepted": accepted,
        **({"since_run": since_run} if since_run else {}),
    }


def at_attempt_start(
    run_dir: Path, attempt: int, env: Mapping[str, str], *, resuming: bool, say: Callable[[str], Any] = print
) -> str | None:
    """Record this attempt's environment and compare it with the last one that trained. Returns the
    refusal message when a deciding package changed, the attempt would resume from a checkpoint and
    the run was not started with allow_env_change (nothing is then recorded as this attempt's);
    other differences only go to the events. A record that cannot be made is said, never fatal."""
    try:
        return _at_attempt_start(run_dir, attempt, env, resuming)
    except (OSError, StateError) as exc:
        say(f"ftlaunch: the environment of attempt {attempt} was not recorded: {exc}")
        return None


def _at_attempt_start(run_dir: Path, attempt: int, env: Mapping[str, str], resuming: bool) -> str | None:
    t0 = time.perf_counter()
    state = read_state(run_dir)
    now = trainer_environment(env, gpus=bool(state.gpu_count), attempt=attempt)
    try:
        previous, since_run = recorded(run_dir, before=attempt), None
    except UnreadableRecord as exc:  # said in the events; this attempt's own record is still made
        journal.note(run_dir, Event.ENVIRONMENT_UNREADABLE, attempt=attempt, message=exc.message)
        previous, since_run = None, None
    if previous is None and state.schedule and attempt == 1:
        found = _previous_of_schedule(run_dir, env, state.schedule)
        if found is not None:
            since_run, previous = found
    diff = compare(previous, now) if previous is not None else EnvDiff()
    refused = bool(diff.deciding) and resuming and since_run is None and not state.allow_env_change
    fields = diff.to_json()
    if refused:
        journal.note(run_dir, Event.ENVIRONMENT_CHANGED, attempt=attempt, refused=True, **fields)
        journal.environment_kept(run_dir, _kept(state).with_(changed=_changed_note(attempt, diff, False, None)))
        return (
            f"the trainer's environment changed since attempt {previous.attempt if previous else '?'}, whose "
            f"checkpoint this attempt would resume ({diff.summary()}); not resumed: {ALLOW_HINT}\n"
            + diff_table(diff.deciding)
        )
    write_record(run_dir, now)
    ms = round((time.perf_counter() - t0) * 1000, 1)
    journal.note(run_dir, Event.ENVIRONMENT, attempt=attempt, hash=now.digest(), packages=len(now.packages), ms=ms)
    if diff.changed:
        journal.note(run_dir, Event.ENVIRONMENT_CHANGED, attempt=attempt, refused=False, since_run=since_run, **fields)
    if diff.deciding:  # taken (--allow-env-change, or since the schedule's last run): the destinations hear it
        from ftlaunch.run.notify import notice

        notice(run_dir, env, "env_changed", {**_changed_note(attempt, diff, True, since_run), **fields})
    info = _kept(state).with_(hash=now.digest(), attempt=attempt)
    if diff.deciding:
        info = info.with_(changed=_changed_note(attempt, diff, True, since_run))
    journal.environment_kept(run_dir, info)
    return None


def _kept(state: RunState) -> EnvironmentRecord:
    """The environment record the state keeps (an empty one when it keeps none yet)."""
    return state.environment or EnvironmentRecord()


def refuse_resume(run_dir: Path, env: Mapping[str, str], state: RunState, checkpoint: str | None) -> None:
    """`resume` from ``checkpoint``: refused (EnvChangedError, exit 18) with the table when a deciding
    package changed since the last attempt that trained. Reads; writes and starts nothing."""
    if checkpoint is None:
        return
    try:
        previous = recorded(run_dir)
    except UnreadableRecord as exc:  # fails closed: an unknown environment is not an unchanged one
        raise EnvChangedError(
            f"run {run_dir.name}: the environment that wrote {checkpoint} is unknown: {exc.message}; resuming "
            "across a change may not load the checkpoint or train the same",
            hint=f"{ALLOW_HINT} (a new record is made), or move the record aside if it is yours to repair",
        ) from None
    if previous is None:
        return
    diff = compare(previous, trainer_environment(env, gpus=False))
    if not diff.deciding:
        return
    raise EnvChangedError(
        f"run {run_dir.name}: the trainer's environment changed since attempt {previous.attempt}, which wrote "
        f"{checkpoint}; resuming across it may not load the checkpoint or train the same:\n{diff_table(diff.deciding)}",
        hint=f"{ALLOW_HINT}, or put the old versions back (`ftlaunch env --lock {run_dir.name}` writes them out)",
    )


# ---------------------------------------------------------------- `ftlaunch env --lock / --diff`


def last_recorded(run_dir: Path) -> Environment:
    """The environment the run last trained with; NOT_FOUND when it kept none."""
    found = recorded(run_dir)
    if found is None:
        raise FtlaunchError(
            f"run {run_dir.name} has no recorded environment (no attempt started, or it was made by an ftlaunch "
            "that did not record one)",
            hint="`ftlaunch env --diff` needs a run that started an attempt with this ftlaunch",
            exit_code=ExitCode.NOT_FOUND,
        )
    return found


def lock_of_run(run_dir: Path) -> str:
    e = last_recorded(run_dir)
    return lock_text(e, f"ftlaunch env --lock: run {run_dir.name}, attempt {e.attempt}, recorded {e.recorded}")


def diff_of_runs(
    run_dir: Path, other: Path | None, env: Mapping[str, str]
) -> tuple[tuple[str, Environment], tuple[str, Environment], EnvDiff]:
    """((label, environment) before, after, what differs): ``run_dir`` against ``other``, or against
    the trainer's environment on this machine now."""
    a = last_recorded(run_dir)
    if other is not None:
        b, label = last_recorded(other), f"run {other.name}"
    else:
        b, label = trainer_environment(env), "this machine now"
    return (f"run {run_dir.name}", a), (label, b), compare(a, b)
