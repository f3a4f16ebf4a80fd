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

Here: the pure parts that find what to download (``dataset_names``, ``hub_datasets``, ``download_patterns``) and
the shell that reads the file and downloads (``prefetch_datasets``), which returns plain values
(``DatasetPrefetch``). Writing the run's copy and the Changes it makes is planning's:
``ftlaunch.plan.prepared`` (``adapt_dataset_info``, ``adapt_config``, ``final_plan``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftlaunch.errors import ConfigError
from ftlaunch.files import JSON_LIMIT, read_user_bytes
from ftlaunch.hub.repo import HubSettings, is_repo_id
from ftlaunch.plan.datainfo import INFO_FILE, ONLINE, OTHER_HUBS


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


@dataclass(frozen=True)
class DatasetPrefetch:
    """What ``prefetch_datasets`` did: plain values (planning turns them into the run's dataset_info.json and
    its Changes, ``ftlaunch.plan.prepared.final_plan``). No ``downloads``: nothing was, ``warnings`` say why."""

    dataset_dir: str = ""  # the original folder, absolute, or ONLINE
    info: dict[str, Any] | None = None  # its dataset_info.json as the user wrote it (None for ONLINE)
    entries: tuple[HubDataset, ...] = ()  # the named hub datasets (hub_datasets of info and the names)
    endpoint: str | None = None
    endpoint_reason: str = ""
    downloads: tuple[dict[str, Any], ...] = ()  # per repo: repo_id, path, endpoint(_reason), files, bytes, retries
    warnings: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------------------ shell
def read_dataset_info(dataset_dir: str) -> dict[str, Any] | None:
    """dataset_info.json of ``dataset_dir`` (None for ONLINE)."""
    if dataset_dir == ONLINE:
        return None
    path = Path(dataset_dir) / INFO_FILE
    try:
        data = json.loads(read_user_bytes(path, limit=JSON_LIMIT, what=f"dataset_dir: {path}", error=ConfigError))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"dataset_dir: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"dataset_dir: {path} is not a JSON object")
    return data


def prefetch_datasets(
    values: Mapping[str, Any],
    mirror: str | None,
    env: Mapping[str, str],
    *,
    cwd: str | Path | None = None,
    progress: bool = True,
    on_retry: Callable[..., None] | None = None,
) -> DatasetPrefetch | None:
    """Download the hub datasets named in ``values`` (paths already resolved): what was downloaded, from where, to
    which snapshot, with the dataset_info.json that names them. None when the config names no hub dataset."""
    from ftlaunch import hub

    names = dataset_names(values)
    if not names:
        return None
    dataset_dir = str(values.get("dataset_dir", "data"))
    if dataset_dir.startswith("REMOTE:"):
        return DatasetPrefetch(
            warnings=(
                f"dataset_dir {dataset_dir}: the dataset list lives on the hub; its datasets are not pre-downloaded",
            )
        )
    if dataset_dir != ONLINE and not os.path.isabs(dataset_dir):
        dataset_dir = str((Path(cwd or os.getcwd()) / dataset_dir).resolve())
    info = read_dataset_info(dataset_dir)
    refs = hub_datasets(info, names, cwd=Path(cwd or os.getcwd()))
    warnings = [
        f"dataset {n}: only on ModelScope/Modelers ({', '.join(k for k in OTHER_HUBS if k in info[n])}), "
        "not pre-downloaded"
        for n in names
        if info is not None
        and isinstance(info.get(n), Mapping)
        and "hf_hub_url" not in info[n]
        and any(k in info[n] for k in OTHER_HUBS)
    ]
    if not refs:
        return DatasetPrefetch(warnings=tuple(warnings)) if warnings else None

    first = refs[0].repo_id
    choice = hub.choose_endpoint(first, mirror, env, repo_type="dataset")
    if choice.use_modelscope:
        return DatasetPrefetch(
            warnings=(
                *warnings,
                f"hub dataset(s) {', '.join(r.repo_id for r in refs)}: not pre-downloaded from ModelScope "
                "(Hugging Face hub datasets only); use --mirror hf / hf-mirror / URL",
            ),
        )
    settings = HubSettings.from_env(env)
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
    # The run's dataset_info.json names every hub entry, a downloaded one by its snapshot (so without cwd: a
    # name that is also a local folder there was not downloaded and keeps its hub url).
    entries = tuple(hub_datasets(info, names))
    return DatasetPrefetch(dataset_dir, info, entries, choice.url, choice.reason, tuple(downloads), tuple(warnings))
