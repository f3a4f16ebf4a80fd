"""A hub repository as a config names it, and where its downloads go.

`is_repo_id` is the one rule for "does this value name a hub repo" (a model's
model_name_or_path, a dataset's hf_hub_url or an ONLINE dataset name). `HubSettings` reads the
cache folder and the token from the environment, in one place, at call time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def is_repo_id(value: Any, *, cwd: str | Path | None = None) -> bool:
    """``org/name`` or a bare ``name``: a non-blank string with at most one ``/`` that is no
    absolute, home, dot-relative or Windows path. With ``cwd``, also not a file or folder that
    exists there: a local path wins (transformers and datasets load it from disk)."""
    return (
        isinstance(value, str)
        and bool(value.strip())
        and value.count("/") <= 1
        and not value.startswith(("/", ".", "~"))
        and not os.path.isabs(value)
        and "\\" not in value
        and not (cwd is not None and (Path(cwd) / value).exists())
    )


@dataclass(frozen=True)
class HubSettings:
    """Where snapshots go (None: huggingface_hub's default) and the token to send (never printed)."""

    cache_dir: str | None = None
    token: str | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> HubSettings:
        """HF_HUB_CACHE, else HF_HOME/hub; HF_TOKEN, else the older HUGGING_FACE_HUB_TOKEN."""
        cache = env.get("HF_HUB_CACHE") or (str(Path(env["HF_HOME"]) / "hub") if env.get("HF_HOME") else None)
        return cls(cache, env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN") or None)
