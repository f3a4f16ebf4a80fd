"""Verification of a downloaded snapshot: sizes, LFS sha256, every shard of an index, no partials."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import VerifyError
from ..files import JSON_LIMIT, read_user_bytes, value_error
from .results import ExpectedFile

log = logging.getLogger(__name__)


def verify_snapshot(path: Path, expected: Sequence[ExpectedFile]) -> None:
    """Raise VerifyError listing every problem: missing files, wrong sizes, wrong sha256 (where given),
    safetensors index shards that are missing, and ``*.incomplete`` files left in the cache's blobs folder."""
    problems = [problem for _, problem in _check_snapshot(Path(path), expected)]
    if problems:
        raise _verify_error(Path(path), problems, hint="delete the files named above and download again")


def _verify_error(path: Path, problems: Sequence[str], *, hint: str) -> VerifyError:
    lines = "\n".join(f"  - {p}" for p in problems)
    err = VerifyError(f"verification of {path} failed: {len(problems)} problem(s):\n{lines}", hint=hint)
    err.problems = list(problems)  # type: ignore[attr-defined]
    return err


def _check_snapshot(path: Path, expected: Sequence[ExpectedFile]) -> list[tuple[str | None, str]]:
    """(rfilename or None, problem) for everything wrong; the file name is set where the file itself is bad."""
    problems: list[tuple[str | None, str]] = []
    to_hash: list[tuple[str, Path, str]] = []
    if not path.is_dir():
        return [(None, f"snapshot folder {path} does not exist")]
    for rfilename, size, sha256 in expected:
        f = path / rfilename
        if not f.is_file():
            problems.append((None, f"{rfilename}: missing"))
            continue
        actual = f.stat().st_size
        if size is not None and actual != size:
            problems.append((rfilename, f"{rfilename}: size {actual} bytes, expected {size}"))
            continue
        if sha256:
            to_hash.append((rfilename, f, sha256.lower()))
    if to_hash:
        # hashlib releases the GIL on large buffers, so several shards hash in parallel (disk permitting).
        with ThreadPoolExecutor(max_workers=min(8, len(to_hash))) as pool:
            digests = list(pool.map(lambda item: _sha256_file(item[1]), to_hash))
        for (rfilename, _, want), got in zip(to_hash, digests, strict=True):
            if got != want:
                problems.append((rfilename, f"{rfilename}: sha256 {got}, expected {want}"))
    for index in sorted(path.rglob("*.safetensors.index.json")):
        rel = index.relative_to(path).as_posix()
        try:
            weight_map = json.loads(read_user_bytes(index, limit=JSON_LIMIT, what=rel, error=value_error))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            problems.append((rel, f"{rel}: unreadable safetensors index ({type(exc).__name__})"))
            continue
        for shard in shards:
            if not (index.parent / shard).is_file():
                problems.append((None, f"{rel} lists {shard}, which is missing"))
    if path.parent.name == "snapshots":
        blobs = path.parent.parent / "blobs"
        for partial in sorted(blobs.glob("*.incomplete")) if blobs.is_dir() else []:
            problems.append((None, f"unfinished download left in the cache: {partial.name}"))
    return problems


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * 1024 * 1024):
            h.update(chunk)
    return h.hexdigest()


def _quarantine(snapshot: Path, rfilenames: Iterable[str]) -> None:
    """Remove bad files (snapshot link and the blob behind it) so the next download fetches them again;
    otherwise huggingface_hub would see the link and never re-download."""
    blobs = (snapshot.parent.parent / "blobs").resolve() if snapshot.parent.name == "snapshots" else None
    for rfilename in rfilenames:
        link = snapshot / rfilename
        try:
            target = link.resolve()
            if blobs is not None and target.parent == blobs:
                target.unlink(missing_ok=True)
            link.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not remove bad file %s: %s", link, exc)
