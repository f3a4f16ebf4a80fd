"""The final plan: what the shells around planning found, as rows of the plan table. Pure.

Before ``planner.plan`` runs, the shell (``ftlaunch.run.prepare``) resolves the config's paths and,
with ``--mirror``, downloads the model and the hub datasets; ``ftlaunch.hub`` returns plain values
(what was fetched, from where, to which local path: ``ModelSnapshot``, ``DatasetSnapshots`` here are
what this module reads of them). ``final_plan`` turns those values into Changes on the planned
config (``model_name_or_path``, ``dataset_dir``/``media_dir``, each ``dataset_info[NAME].hf_hub_url``),
the trainer's offline env and the run folder's own dataset_info.json, and names the run the plan is
for: its id and config key, made once by the shell and passed in. Nothing edits the Plan after it.

How LLaMA-Factory reads the run's dataset_info.json, and why it is written this way: ``ftlaunch.hub.datasets``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from ftlaunch.plan.change import Change
from ftlaunch.plan.datainfo import INFO_FILE, ONLINE, OTHER_HUBS
from ftlaunch.plan.planner import Plan


class ModelSnapshot(Protocol):
    """A model downloaded from the hub (``ftlaunch.hub.model.Prefetch``)."""

    @property
    def endpoint(self) -> str | None: ...  # None: ModelScope
    @property
    def endpoint_reason(self) -> str: ...
    @property
    def path(self) -> str: ...
    def to_dict(self) -> dict[str, Any]: ...


class HubEntry(Protocol):
    """A dataset name LLaMA-Factory would load from the hub, and its repo (``ftlaunch.hub.datasets.HubDataset``)."""

    @property
    def name(self) -> str: ...
    @property
    def repo_id(self) -> str: ...


class DatasetSnapshots(Protocol):
    """The hub datasets of a config, downloaded (``ftlaunch.hub.datasets.DatasetPrefetch``)."""

    @property
    def dataset_dir(self) -> str: ...  # the original folder, absolute, or ONLINE
    @property
    def info(self) -> Mapping[str, Any] | None: ...  # its dataset_info.json as the user wrote it (None: ONLINE)
    @property
    def entries(self) -> Sequence[HubEntry]: ...
    @property
    def endpoint(self) -> str | None: ...
    @property
    def endpoint_reason(self) -> str: ...
    @property
    def downloads(self) -> Sequence[Mapping[str, Any]]: ...  # per repo: repo_id, path, endpoint, files, bytes...
    @property
    def warnings(self) -> Sequence[str]: ...


def adapt_dataset_info(
    info: Mapping[str, Any] | None,
    entries: Iterable[HubEntry],
    downloaded: Mapping[str, str],
    dataset_dir: str,
    *,
    why: str = "pre-downloaded",
) -> tuple[dict[str, Any], list[Change]]:
    """The dataset_info.json for the run folder, and one Change per entry pointed at a local snapshot.

    ``entries``: the named hub datasets (``hub.datasets.hub_datasets``). ``downloaded``: repo id -> absolute
    snapshot path. ``dataset_dir``: the absolute original folder (ignored for ONLINE, ``info`` None). Named hub
    entries whose repo is in ``downloaded`` get ``hf_hub_url`` = the snapshot path (everything else kept, other
    hubs' urls dropped); relative ``file_name``/``script_url`` of all entries are made absolute against
    ``dataset_dir``; the rest is copied as is.
    """
    wanted = {ref.name: ref for ref in entries}
    changes: list[Change] = []
    reason = f"{why}; the local copy is loaded with HF_DATASETS_OFFLINE=1"
    if info is None:
        out: dict[str, Any] = {}
        for name, ref in wanted.items():
            local = downloaded.get(ref.repo_id)
            out[name] = {"hf_hub_url": local or ref.repo_id}
            if local:
                changes.append(Change(f"dataset_info[{name}].hf_hub_url", ref.repo_id, local, reason))
        return out, changes
    out = {}
    for name, entry in info.items():
        if not isinstance(entry, Mapping):
            out[name] = entry
            continue
        new = dict(entry)
        ref = wanted.get(name)
        local = downloaded.get(ref.repo_id) if ref is not None else None
        if ref is not None and local:
            new["hf_hub_url"] = local
            for key in OTHER_HUBS:
                new.pop(key, None)
            changes.append(Change(f"dataset_info[{name}].hf_hub_url", ref.repo_id, local, reason))
        for key in ("file_name", "script_url"):
            value = new.get(key)
            if isinstance(value, str) and value and not os.path.isabs(value) and key in _local_keys(new):
                new[key] = os.path.join(dataset_dir, value)
        out[name] = new
    return out, changes


def _local_keys(entry: Mapping[str, Any]) -> tuple[str, ...]:
    """The key LLaMA-Factory reads a local path from, given its precedence (hub urls > script > file)."""
    if any(k in entry for k in ("hf_hub_url", *OTHER_HUBS)):
        return ()
    if "script_url" in entry:
        return ("script_url",)
    if "cloud_file_name" in entry:
        return ()
    return ("file_name",)


def adapt_config(
    values: Mapping[str, Any], repo_ids: Iterable[str], *, run_dir: str | Path
) -> tuple[dict[str, Any], list[Change]]:
    """Config keys to set so LLaMA-Factory reads the run's dataset_info.json: ``dataset_dir`` (and ``media_dir``)."""
    old = str(values.get("dataset_dir", "data"))
    repos = ", ".join(sorted(set(repo_ids)))
    run_dir = str(run_dir)
    updates: dict[str, Any] = {"dataset_dir": run_dir}
    if old == ONLINE:
        why = f"the run's own {INFO_FILE} points the hub dataset(s) {repos} to their local snapshots"
    else:
        why = (
            f"the run's own {INFO_FILE} points the hub dataset(s) {repos} to their local snapshots and every "
            f"other entry to {old} (whose {INFO_FILE} is left unchanged)"
        )
    changes = [Change("dataset_dir", values.get("dataset_dir"), run_dir, why)]
    if old != ONLINE and not old.startswith("REMOTE:") and not values.get("media_dir"):
        updates["media_dir"] = old
        changes.append(
            Change(
                "media_dir",
                None,
                old,
                "LLaMA-Factory defaults media_dir to dataset_dir, which is now the run folder: "
                "media paths stay relative to the original dataset folder",
            )
        )
    return updates, changes


def final_plan(
    p: Plan,
    *,
    run_id: str | None = None,
    memory_key: str | None = None,
    warnings: Sequence[str] = (),
    resolved_paths: Sequence[str] = (),
    model: ModelSnapshot | None = None,
    weights: bool = False,
    datasets: DatasetSnapshots | None = None,
    run_dir: str | Path | None = None,
    offline_env: Mapping[str, str] | None = None,
) -> Plan:
    """``p`` (the planner's) with what the shells found, for run ``run_id`` (``memory_key``: its config key).

    ``warnings``: the shell's, said before the planner's. ``resolved_paths``: config keys made absolute.
    ``model``: the pre-downloaded model; with ``weights`` the trainer loads that snapshot, offline (else only
    its config.json was fetched, for sizing). ``datasets``: the pre-downloaded hub datasets, whose dataset_info.json
    goes into the run's folder ``run_dir`` (``Plan.files``, written by create_run). ``offline_env``: the trainer's
    env once its files are on disk (``hub.offline_env()``)."""
    config = dict(p.config)
    changes = list(p.changes)
    env = dict(p.env)
    said = [*warnings, *p.warnings]
    files = dict(p.files)
    offline = dict(offline_env or {})
    if model is not None and weights:
        why = (
            f"pre-downloaded from {model.endpoint or 'ModelScope'} ({model.endpoint_reason}); "
            "the trainer then runs with HF_HUB_OFFLINE=1"
        )
        changes.append(Change("model_name_or_path", config.get("model_name_or_path"), model.path, why))
        config["model_name_or_path"] = model.path
        env.update(offline)
    downloads: tuple[Mapping[str, Any], ...] = ()
    if datasets is not None and datasets.downloads:
        if run_dir is None:
            raise ValueError("final_plan: downloaded datasets need the run's folder (run_dir)")
        downloads = tuple(dict(x) for x in datasets.downloads)
        downloaded = {str(x["repo_id"]): str(x["path"]) for x in downloads}
        why = f"pre-downloaded from {datasets.endpoint} ({datasets.endpoint_reason})"
        info, info_changes = adapt_dataset_info(
            datasets.info, datasets.entries, downloaded, datasets.dataset_dir, why=why
        )
        updates, config_changes = adapt_config(
            {**config, "dataset_dir": datasets.dataset_dir}, downloaded, run_dir=run_dir
        )
        config.update(updates)
        changes += [*config_changes, *info_changes]
        env.update(offline)
        files[INFO_FILE] = info
    if datasets is not None:
        said += datasets.warnings
    return replace(
        p,
        config=config,
        changes=tuple(changes),
        env=env,
        warnings=tuple(said),
        resolved_paths=tuple(resolved_paths),
        hub=model.to_dict() if model is not None else None,
        hub_datasets=downloads,
        run_id=run_id,
        memory_key=memory_key,
        files=files,
    )
