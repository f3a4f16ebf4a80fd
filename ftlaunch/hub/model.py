"""ftlaunch.hub.model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
