"""Where a schedule's runs land: version directories ``<output_dir>/<name>-<UTC time>``.

Pure: version names, the prune choice, which local dataset files a config names.
Shell: the config's own output_dir, the content hash for ``--only-if-changed``, the ``latest`` link,
pruning old versions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from collections.abc import Collection, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ftlaunch.errors import ConfigError, StateError
from ftlaunch.files import JSON_LIMIT, read_user_bytes, value_error
from ftlaunch.schedule.records import EntryStatus, HistoryEntry, ScheduleRecord


def version_name(name: str, when: datetime, taken: Collection[str] = ()) -> str:
    """``<name>-<UTC timestamp>``, with ``-2``, ``-3`` ... when two runs start in the same second."""
    base = f"{name}-{when.astimezone(UTC):%Y%m%dT%H%M%SZ}"
    candidate, n = base, 2
    while candidate in taken:
        candidate, n = f"{base}-{n}", n + 1
    return candidate


def choose_prune(history: Sequence[HistoryEntry], keep: int | None, latest: str | None) -> list[str]:
    """Version dirs to delete: successful ones older than the ``keep`` newest.

    Never the latest, never a run that did not succeed (its logs and checkpoints stay), never one
    that is not in the history (ftlaunch did not make it).
    """
    if not keep:
        return []
    done: list[str] = []
    for h in history:
        d = h.output_dir
        if h.status is EntryStatus.SUCCEEDED and d and not h.pruned and d not in done:
            done.append(d)
    spare = set(done[-keep:]) | ({latest} if latest else set())
    not_succeeded = {h.output_dir for h in history if h.status is not EntryStatus.SUCCEEDED}
    return [d for d in done if d not in spare and d not in not_succeeded]


def dataset_files(values: Mapping[str, Any], info: Mapping[str, Any]) -> tuple[list[str], list[Mapping[str, Any]]]:
    """Local files named by ``dataset``/``eval_dataset`` in dataset_info.json, and the hub entries."""
    files: list[str] = []
    remote: list[Mapping[str, Any]] = []
    for key in ("dataset", "eval_dataset"):
        names = values.get(key) or []
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",") if n.strip()]
        for n in names:
            entry = info.get(n)
            if not isinstance(entry, Mapping):
                continue
            if entry.get("file_name"):
                files.append(str(entry["file_name"]))
            else:
                remote.append({n: entry})  # hub/script datasets: the entry, not the bytes
    return files, remote


def content_hash(values: Mapping[str, Any], env_base: Path) -> str:
    """sha256 of the config (as merged and resolved) and of every local dataset file it names."""
    h = hashlib.sha256()
    stable = {k: v for k, v in sorted(values.items()) if k != "output_dir"}
    h.update(json.dumps(stable, sort_keys=True, default=str).encode())
    ddir = Path(str(values.get("dataset_dir") or "data"))
    ddir = ddir if ddir.is_absolute() else env_base / ddir
    info_path = ddir / "dataset_info.json"
    try:
        info = json.loads(read_user_bytes(info_path, limit=JSON_LIMIT, what=str(info_path), error=value_error))
        _hash_file(h, info_path)
    except (OSError, ValueError):
        info = {}
        h.update(b"no dataset_info.json")
    names, remote = dataset_files(values, info if isinstance(info, dict) else {})
    h.update(json.dumps(remote, sort_keys=True, default=str).encode())
    for name in names:
        p = Path(name) if Path(name).is_absolute() else ddir / name
        files = sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]
        for f in files:
            _hash_file(h, f)
    return h.hexdigest()


def _hash_file(h: Any, path: Path) -> None:
    h.update(f"\0{path}\0".encode())
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block, /dev/zero never end
            h.update(b"not a regular file")
            return
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError as exc:
        h.update(f"unreadable: {exc.strerror}".encode())


def set_latest(base: Path, version: str) -> None:
    """Point ``<base>/latest`` at ``version`` with one rename (readers never see it missing)."""
    link = base / "latest"
    if link.exists() and not link.is_symlink():
        raise StateError(f"{link} exists and is not a symlink; not replacing it", hint="move it away")
    tmp = base / f".latest.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(version)
    os.replace(tmp, link)


def base_output_dir(rec: ScheduleRecord) -> tuple[Path, dict[str, Any], Path]:
    """The config's own output_dir (absolute), its resolved values and its base directory. Secret
    overrides (``key=***`` in the record) are left out: no output_dir or content hash depends on them."""
    from ftlaunch.plan.config import load_config, resolve_paths, secret_override

    loaded = load_config(rec.config, [o for o in rec.overrides if not secret_override(o)], cwd=rec.cwd)
    values, _, _ = resolve_paths(loaded.values, loaded.base_dir, strict=False)
    out = values.get("output_dir")
    if not out:
        raise ConfigError(
            "a scheduled config needs output_dir: each run trains into <output_dir>/<name>-<UTC time>",
            hint="add output_dir to the YAML or as an override: output_dir=saves/nightly",
        )
    return Path(str(out)), values, loaded.base_dir


def prune(base: Path, rec: ScheduleRecord) -> list[str]:
    """Delete the version dirs ``choose_prune`` picks; returns those now gone."""
    name = rec.name
    chosen = choose_prune(rec.history, rec.keep, str(base / rec.latest) if rec.latest else None)
    done = []
    for d in chosen:
        p = Path(d)
        # Only what this schedule made: a direct child of its output_dir named <name>-<time>.
        if p.parent == base and p.name.startswith(f"{name}-") and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
            done.append(d)
        elif not p.exists():
            done.append(d)
    return done
