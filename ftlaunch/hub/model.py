"""Pre-download a model (or only its tokenizer files or config.json) for a config: choose the endpoint, download into
the hub cache, and say where it came from (`Prefetch`, a plain value: planning turns it into the
plan's ``model_name_or_path`` change, ftlaunch.plan.prepared.final_plan)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ftlaunch.hub.repo import HubSettings

# What a tokenizer (and its processor) loads, without the weights: what `estimate` needs to count tokens of a
# hub model. config.json too (AutoTokenizer reads the model type from it; the plan sizes the model with it).
TOKENIZER_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges.txt",
    "*.tiktoken",
    "spiece.model",
    "sentencepiece*.model",
    "chat_template*",
    "*processor_config.json",
]
# Which files of a snapshot a prefetch takes: the whole snapshot (train), the tokenizer (estimate), config.json
# (plan).
FILE_PATTERNS: dict[str, list[str] | None] = {
    "all": None,
    "tokenizer": TOKENIZER_PATTERNS,
    "config": ["config.json"],
}


@dataclass(frozen=True)
class Prefetch:
    """A model snapshot on disk: where it came from and why that endpoint, and what it took."""

    repo_id: str
    endpoint: str | None
    endpoint_reason: str
    path: str
    files: int
    bytes: int
    retries: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def prefetch_model(
    repo_id: str,
    mirror: str | None,
    env: Mapping[str, str],
    *,
    revision: str | None = None,
    files: str = "all",
    progress: bool = True,
    on_retry: Any = None,
    repo_type: str = "model",
) -> Prefetch:
    """Choose an endpoint and download ``repo_id`` into the hub cache: ``files`` names a row of
    FILE_PATTERNS (the whole snapshot, its tokenizer files, or just its config.json)."""
    from ftlaunch import hub

    choice = hub.choose_endpoint(repo_id, mirror, env, repo_type=repo_type)
    endpoint = hub.MODELSCOPE if choice.use_modelscope else choice.url
    settings = HubSettings.from_env(env)
    result = hub.download(
        repo_id,
        endpoint=endpoint or "hf",
        revision=revision,
        cache_dir=settings.cache_dir,
        token=settings.token,
        progress=progress,
        on_retry=on_retry,
        allow_patterns=FILE_PATTERNS[files],
        repo_type=repo_type,
    )
    return Prefetch(repo_id, choice.url, choice.reason, result.path, result.files, result.bytes, result.retries)
