"""Hub datasets named in a config: download them before training, so the offline trainer finds them.

How LLaMA-Factory (0.9.5, ``data/parser.py`` and ``data/loader.py``) loads a dataset: each name in ``dataset`` /
``eval_dataset`` (comma lists) is a key of ``<dataset_dir>/dataset_info.json`` (with ``dataset_dir: ONLINE`` the
name itself is a hub repo id). An entry with ``hf_hub_url`` is loaded with ``datasets.load_dataset(hf_hub_url,
name=subset, data_dir=folder, split=split, ...)``, which needs the network: with ``HF_DATASETS_OFFLINE=1`` it fails
unless the dataset was loaded before into the datasets cache, and a plain hub snapshot is not that.

What is done about it (train with ``--mirror`` only): each such repo is downloaded as a snapshot (``hub.download``
with ``repo_type="dataset"``), then a copy of ``dataset_info.json`` is written into the run's own folder in which

* that entry's ``hf_hub_url`` is the absolute path of the snapshot. ``load_dataset`` on a local folder resolves
  ``name`` (README ``configs:``), ``data_dir`` and ``split`` exactly like it does for the hub repo, offline, so
  ``subset``, ``folder``, ``split``, ``formatting``, ``columns``, ``tags``... all keep their meaning. (A
  ``file_name`` entry would not: LLaMA-Factory would list every file of the folder, README.md and .gitattributes
  included, and ignore ``subset``; ``split`` would have to be "train".) ``ms_hub_url``/``om_hub_url`` are dropped
  from that entry, so the local copy is used whatever USE_MODELSCOPE_HUB / USE_OPENMIND_HUB say;
* every other entry keeps working from the new place: relative ``file_name`` / ``script_url`` are made absolute
  against the original ``dataset_dir`` (LLaMA-Factory joins them with ``os.path.join(dataset_dir, ...)``, which
  keeps an absolute path as is).

The adapted config's ``dataset_dir`` becomes the run folder (its path is fixed before planning: the plan carries
the run's id and the adapted ``dataset_info.json`` in ``Plan.files``, which ``create_run`` writes there) and, when
the config does not set ``media_dir`` (which defaults to ``dataset_dir``), ``media_dir`` becomes the original
folder so relative image/video/audio paths still resolve. The user's ``dataset_info.json`` is never modified.

Pure parts (``dataset_names``, ``hub_datasets``, ``download_patterns``, ``adapt_dataset_info``, ``adapt_config``,
``with_datasets``) take and return plain data; ``prefetch_datasets`` is the shell that reads the
file and downloads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ftlaunch.errors import ConfigError
from ftlaunch.hub.download import offline_env
from ftlaunch.hub.repo import HubSettings, is_repo_id
from ftlaunch.plan.change import Change
from ftlaunch.plan.planner import Plan

INFO_FILE = "dataset_info.json"
SUMMARY_KEY = "hub_datasets"  # Plan.extra: what was downloaded (goes into plan.json)
ONLINE = "ONLINE"
_OTHER_HUBS = ("ms_hub_url", "om_hub_url")


@dataclass(frozen=True)
class HubDataset:
    name: str  # the key in dataset_info.json (with dataset_dir ONLINE: the repo id itself)
    repo_id: str
    folder: str | None = None


# ------------------------------------------------------------------------------------------------ pure
def dataset_names(values: Mapping[str, Any]) -> list[str]:
    """The names in ``dataset`` and ``eval_dataset`` (comma lists or YAML lists), in order, without repeats."""
    names: list[str] = []
    for key in ("dataset", "eval_dataset"):
        value = values.get(key)
        items = value if isinstance(value, (list, tuple)) else str(value or "").split(",")
        for item in items:
            name = str(item).strip()
            if name and name not in names:
                names.append(name)
    return names


def hub_datasets(
    info: Mapping[str, Any] | None, names: Iterable[str], cwd: str | Path | None = None
) -> list[HubDataset]:
    """The named datasets that LLaMA-Factory would load from the Hugging Face hub.

    ``info`` is dataset_info.json, or None for ``dataset_dir: ONLINE`` (then every name is a repo id).
    Names missing from ``info`` are left to LLaMA-Factory's own error. With ``cwd``, a value that names
    an existing file or folder there is local (``datasets`` loads it from disk), not a hub repo."""
    found: list[HubDataset] = []
    for name in names:
        if info is None:
            if is_repo_id(name, cwd=cwd):
                found.append(HubDataset(name, name))
            continue
        entry = info.get(name)
        if not isinstance(entry, Mapping):
            continue
        url = entry.get("hf_hub_url")
        if is_repo_id(url, cwd=cwd):
            folder = entry.get("folder")
            found.append(HubDataset(name, str(url), str(folder) if folder else None))
    return found


def download_patterns(refs: Iterable[HubDataset]) -> dict[str, list[str] | None]:
    """Per repo, what to download: everything (None), or only the ``folder``s used plus the dataset card.

    The card (README.md) carries the ``configs:`` that ``load_dataset`` reads for subsets and splits."""
    out: dict[str, list[str] | None] = {}
    for ref in refs:
        folder = (ref.folder or "").strip("/")
        if ref.repo_id in out and out[ref.repo_id] is None:
            continue
        if not folder:
            out[ref.repo_id] = None
            continue
        patterns = out.setdefault(ref.repo_id, ["README.md"])
        assert patterns is not None
        if f"{folder}/*" not in patterns:
            patterns.append(f"{folder}/*")  # fnmatch: * also matches "/", so this takes the whole subtree
    return out


def adapt_dataset_info(
    info: Mapping[str, Any] | None,
    names: Iterable[str],
    downloaded: Mapping[str, str],
    dataset_dir: str,
    *,
    why: str = "pre-downloaded",
) -> tuple[dict[str, Any], list[Change]]:
    """The dataset_info.json for the run folder, and one Change per entry pointed at a local snapshot.

    ``downloaded``: repo id -> absolute snapshot path. ``dataset_dir``: the absolute original folder (ignored
    for ONLINE, ``info`` None). Named hub entries whose repo is in ``downloaded`` get ``hf_hub_url`` = the
    snapshot path (everything else kept, other hubs' urls dropped); relative ``file_name``/``script_url`` of all
    entries are made absolute against ``dataset_dir``; the rest is copied as is.
    """
    wanted = {ref.name: ref for ref in hub_datasets(info, names)}
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
            for key in _OTHER_HUBS:
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
    if any(k in entry for k in ("hf_hub_url", *_OTHER_HUBS)):
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


@dataclass(frozen=True)
class DatasetPrefetch:
    info: dict[str, Any]  # the adapted dataset_info.json
    config: dict[str, Any]  # config keys to set
    changes: tuple[Change, ...]
    downloads: tuple[dict[str, Any], ...]  # per repo: repo_id, path, endpoint, files, bytes, retries
    warnings: tuple[str, ...] = field(default=())


def with_datasets(p: Plan, d: DatasetPrefetch, run_id: str) -> Plan:
    """The plan for run ``run_id`` with the adapted config, the changes, the offline env and the run's own
    dataset_info.json (``Plan.files``, written by create_run)."""
    if not d.downloads:
        return replace(p, warnings=(*p.warnings, *d.warnings))
    return replace(
        p,
        config={**p.config, **d.config},
        changes=(*p.changes, *d.changes),
        env={**p.env, **offline_env()},
        extra={**dict(p.extra), SUMMARY_KEY: [dict(x) for x in d.downloads]},
        warnings=(*p.warnings, *d.warnings),
        run_id=run_id,
        files={**dict(p.files), INFO_FILE: d.info},
    )


# ------------------------------------------------------------------------------------------------ shell
def read_dataset_info(dataset_dir: str) -> dict[str, Any] | None:
    """dataset_info.json of ``dataset_dir`` (None for ONLINE)."""
    if dataset_dir == ONLINE:
        return None
    path = Path(dataset_dir) / INFO_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"dataset_dir: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"dataset_dir: {path} is not a JSON object")
    return data


def prefetch_datasets(
    values: Mapping[str, Any],
    mirror: str | None,
    env: Mapping[str, str],
    *,
    run_dir: str | Path,
    cwd: str | Path | None = None,
    progress: bool = True,
    on_retry: Callable[..., None] | None = None,
) -> DatasetPrefetch | None:
    """Download the hub datasets named in ``values`` (paths already resolved) and adapt dataset_info.json for the
    run whose folder will be ``run_dir``. None when the config names no hub dataset."""
    from ftlaunch import hub

    names = dataset_names(values)
    if not names:
        return None
    dataset_dir = str(values.get("dataset_dir", "data"))
    if dataset_dir.startswith("REMOTE:"):
        return DatasetPrefetch(
            {},
            {},
            (),
            (),
            (f"dataset_dir {dataset_dir}: the dataset list lives on the hub; its datasets are not pre-downloaded",),
        )
    if dataset_dir != ONLINE and not os.path.isabs(dataset_dir):
        dataset_dir = str((Path(cwd or os.getcwd()) / dataset_dir).resolve())
    info = read_dataset_info(dataset_dir)
    refs = hub_datasets(info, names, cwd=Path(cwd or os.getcwd()))
    warnings = [
        f"dataset {n}: only on ModelScope/Modelers ({', '.join(k for k in _OTHER_HUBS if k in info[n])}), "
        "not pre-downloaded"
        for n in names
        if info is not None
        and isinstance(info.get(n), Mapping)
        and "hf_hub_url" not in info[n]
        and any(k in info[n] for k in _OTHER_HUBS)
    ]
    if not refs:
        return DatasetPrefetch({}, {}, (), (), tuple(warnings)) if warnings else None

    first = refs[0].repo_id
    choice = hub.choose_endpoint(first, mirror, env, repo_type="dataset")
    if choice.use_modelscope:
        return DatasetPrefetch(
            {},
            {},
            (),
            (),
            (
                *warnings,
                f"hub dataset(s) {', '.join(r.repo_id for r in refs)}: not pre-downloaded from ModelScope "
                "(Hugging Face hub datasets only); use --mirror hf / hf-mirror / URL",
            ),
        )
    settings = HubSettings.from_env(env)
    downloaded: dict[str, str] = {}
    downloads: list[dict[str, Any]] = []
    for repo_id, patterns in download_patterns(refs).items():
        result = hub.download(
            repo_id,
            endpoint=choice.url or "hf",
            repo_type="dataset",
            cache_dir=settings.cache_dir,
            token=settings.token,
            progress=progress,
            on_retry=on_retry,
            allow_patterns=patterns,
        )
        downloaded[repo_id] = result.path
        downloads.append(
            {
                "repo_id": repo_id,
                "path": result.path,
                "endpoint": choice.url,
                "endpoint_reason": choice.reason,
                "files": result.files,
                "bytes": result.bytes,
                "retries": result.retries,
            }
        )
    why = f"pre-downloaded from {choice.url} ({choice.reason})"
    new_info, info_changes = adapt_dataset_info(info, names, downloaded, dataset_dir, why=why)
    updates, config_changes = adapt_config({**values, "dataset_dir": dataset_dir}, downloaded, run_dir=run_dir)
    return DatasetPrefetch(new_info, updates, (*config_changes, *info_changes), tuple(downloads), tuple(warnings))
