"""The environment a run trains with, as a value: the trainer's Python, the exact version of every
installed distribution, where the ones not from an index came from (PEP 610 direct_url.json), the
CUDA/driver/NVML versions and the GPUs, and a hash of the whole set. Pure: the shell that reads a
Python's site-packages and NVML is ``ftlaunch.run.environment``.

Also pure here: the comparison of two environments (the packages that decide training kept apart
from every other difference), the lock file's text, and the planning notes for defaults that the
installed versions decide.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ftlaunch.plan.memory.setup import default_optimizer

ENV_VERSION = 1

# The packages whose version decides what training does: a resume across a change of one of them
# may not load its checkpoint (optimizer/scheduler formats) or trains with other defaults.
DECIDING = (
    "torch",
    "transformers",
    "llamafactory",
    "peft",
    "accelerate",
    "deepspeed",
    "trl",
    "datasets",
    "bitsandbytes",
)

# What is compared of the CUDA side (not ``why``, which only says why a value is missing).
_SYSTEM_KEYS = ("driver", "cuda_driver", "nvml", "torch_cuda", "gpus")


def canonical(name: str) -> str:
    """PEP 503: the name pip and indexes compare (``Flash_Attn`` and ``flash-attn`` are one)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Environment:
    """One attempt's environment. ``packages``: canonical name -> version (what ``pip freeze`` shows);
    ``sources``: canonical name -> direct_url.json for those installed from a URL, a VCS or a local
    directory; ``system``: driver, cuda_driver, nvml, torch_cuda (torch's build), gpus, why."""

    python: str
    python_version: str | None
    packages: Mapping[str, str]
    sources: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    system: Mapping[str, Any] = field(default_factory=dict)
    recorded: str | None = None
    attempt: int | None = None

    def digest(self) -> str:
        """sha256 of what decides the environment (not the interpreter's path, the time or the attempt)."""
        body = {
            "python_version": self.python_version,
            "packages": dict(sorted(self.packages.items())),
            "sources": {k: dict(v) for k, v in sorted(self.sources.items())},
            "system": {k: self.system.get(k) for k in _SYSTEM_KEYS},
        }
        import hashlib  # here, not at the top: a plan never hashes, and OpenSSL's start costs it ~5 ms

        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()

    def pin(self, name: str) -> str | None:
        """A package's version as compared: with its commit when installed from a VCS, or marked
        editable, so that a new commit of a source checkout is a change too."""
        version = self.packages.get(canonical(name))
        if version is None:
            return None
        src = self.sources.get(canonical(name)) or {}
        commit = (src.get("vcs_info") or {}).get("commit_id")
        if commit:
            return f"{version} ({src['vcs_info'].get('vcs', 'vcs')} {str(commit)[:12]})"
        if (src.get("dir_info") or {}).get("editable"):
            return f"{version} (editable)"
        return version

    def to_json(self) -> dict[str, Any]:
        return {
            "version": ENV_VERSION,
            "attempt": self.attempt,
            "recorded": self.recorded,
            "hash": self.digest(),
            "python": self.python,
            "python_version": self.python_version,
            "system": dict(self.system),
            "sources": {k: dict(v) for k, v in sorted(self.sources.items())},
            "packages": dict(sorted(self.packages.items())),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Environment:
        return cls(
            python=str(d.get("python") or ""),
            python_version=d.get("python_version"),
            packages={canonical(k): str(v) for k, v in (d.get("packages") or {}).items()},
            sources={canonical(k): dict(v) for k, v in (d.get("sources") or {}).items()},
            system=dict(d.get("system") or {}),
            recorded=d.get("recorded"),
            attempt=d.get("attempt"),
        )


@dataclass(frozen=True)
class Difference:
    """One row of a comparison: ``what`` (a package, or python/driver/...), before, after."""

    what: str
    before: Any
    after: Any

    def describe(self) -> str:
        return f"{self.what} {_shown(self.before)} -> {_shown(self.after)}"

    def to_json(self) -> dict[str, Any]:
        return {"what": self.what, "before": self.before, "after": self.after}


@dataclass(frozen=True)
class EnvDiff:
    """``deciding``: changes of the packages in DECIDING (a resume across one needs consent);
    ``other``: every other package; ``system``: python version, driver, CUDA, NVML, GPUs."""

    deciding: tuple[Difference, ...] = ()
    other: tuple[Difference, ...] = ()
    system: tuple[Difference, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.deciding or self.other or self.system)

    def summary(self) -> str:
        """The deciding changes in one line: ``transformers 4.49.0 -> 4.55.0, peft 0.14.0 -> 0.15.0``."""
        return ", ".join(d.describe() for d in self.deciding)

    def to_json(self) -> dict[str, Any]:
        return {
            "deciding": [d.to_json() for d in self.deciding],
            "other": [d.to_json() for d in self.other],
            "system": [d.to_json() for d in self.system],
        }


def compare(before: Environment, after: Environment) -> EnvDiff:
    """What differs from ``before`` to ``after``, deciding packages apart from the rest."""
    deciding, other = [], []
    for name in sorted(set(before.packages) | set(after.packages)):
        a, b = before.pin(name), after.pin(name)
        if a != b:
            (deciding if name in DECIDING else other).append(Difference(name, a, b))
    system = []
    if before.python_version != after.python_version:
        system.append(Difference("python", before.python_version, after.python_version))
    for key in _SYSTEM_KEYS:
        a, b = before.system.get(key), after.system.get(key)
        if a != b:
            system.append(Difference(key, a, b))
    return EnvDiff(tuple(deciding), tuple(other), tuple(system))


def diff_table(rows: tuple[Difference, ...] | list[Difference]) -> str:
    """A plain-text table (package, before, after) for an error message or a terminal."""
    cells = [("package", "before", "after")] + [(d.what, _shown(d.before), _shown(d.after)) for d in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(3)]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def _shown(value: Any) -> str:
    if value is None:
        return "(none)"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) or "(none)"
    return str(value)


# ---------------------------------------------------------------- the lock file

_NOT_PINNED = {"pip"}  # pip installs the lock; pinning it would have pip replace itself midway


def lock_text(env: Environment, title: str) -> str:
    """A requirements file that re-creates ``env`` with pip: ``name==version`` for every
    distribution; a VCS install as ``name @ git+URL@commit``; a local directory or file (nothing
    another machine can reach) as a comment. Names no index and no path of the machine it was made
    on; torch builds of the PyTorch index (``+cu130``, ``+cpu``) are pinned without the local label,
    with the index to use in a comment."""
    lines = [
        f"# {title}",
        f"# Python {env.python_version or '(unknown)'}; environment sha256 {env.digest()}",
        f"# re-create: python{_minor(env.python_version)} -m venv VENV && VENV/bin/pip install -r THIS_FILE",
    ]
    body: list[str] = []
    notes: list[str] = []
    for name, version in sorted(env.packages.items()):
        if name in _NOT_PINNED:
            continue
        src = env.sources.get(name) or {}
        url = str(src.get("url") or "")
        vcs = src.get("vcs_info") or {}
        if vcs and not url.startswith("file:"):
            body.append(f"{name} @ {vcs.get('vcs', 'git')}+{url}@{vcs.get('commit_id')}")
            continue
        if url and not url.startswith("file:"):  # a wheel or sdist from a URL (archive_info)
            body.append(f"{name} @ {url}")
            continue
        if url.startswith("file:"):
            how = "an editable local directory" if (src.get("dir_info") or {}).get("editable") else "a local path"
            notes.append(f"# {name}=={version} was installed from {how}: install it from your own copy of its source")
            continue
        public, label = _split_local(version)
        if label:
            notes.append(
                f"# {name}=={version} is a build with local label +{label}: pinned as {public}; " + _index_hint(label)
            )
        body.append(f"{name}=={public}")
    return "\n".join(lines + notes + body) + "\n"


def _minor(version: str | None) -> str:
    parts = (version or "").split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else "3"


def _split_local(version: str) -> tuple[str, str | None]:
    public, _, label = version.partition("+")
    return public, label or None


def _index_hint(label: str) -> str:
    if re.fullmatch(r"cu\d+|cpu|rocm[\d.]+|xpu", label):
        return f"for that exact build add --extra-index-url https://download.pytorch.org/whl/{label} to pip"
    return "that build is not on PyPI"


# ---------------------------------------------------------------- planning notes


def default_notes(config: Mapping[str, Any], versions: Mapping[str, str | None]) -> list[str]:
    """What the plan assumed of a default the installed versions decide: the optimizer when ``optim``
    is not set (transformers >= 4.54 with torch >= 2.8: adamw_torch_fused; else adamw_torch), and the
    attention kernel when ``flash_attn`` is auto (LLaMA-Factory leaves it to transformers)."""
    notes = []
    tf, torch = versions.get("transformers"), versions.get("torch")
    rule = "transformers >= 4.54 uses adamw_torch_fused on torch >= 2.8, adamw_torch before"
    if not config.get("optim"):
        if not (tf and torch):  # a what-if (--gpu, --hardware): the training machine's stack is unknown
            said = f"the trainer's default decides ({rule}; this plan does not know the versions that will train)"
        else:
            default = default_optimizer(tf, torch)
            said = f"the trainer's default decides, {default} with transformers {tf} and torch {torch} ({rule})"
        notes.append(f"optim is not set: {said}; set optim to keep it across upgrades")
    attn = str(config.get("flash_attn") or "auto").strip().lower()
    if attn == "auto":
        who = f"transformers {tf}" if tf else "the trainer's transformers"
        notes.append(
            f"flash_attn is auto: {who} picks the attention kernel when the model loads "
            "(sdpa where the model supports it, else eager); set flash_attn (sdpa, fa2, disabled) to fix it"
        )
    return notes
