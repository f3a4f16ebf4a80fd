"""Get a model onto local disk before training: pick an endpoint (mirror), download with retries, verify.

What this adds on top of ``huggingface_hub.snapshot_download`` (read against huggingface_hub 1.x):

* Endpoint choice (``choose_endpoint``): explicit mirror > ``HF_ENDPOINT`` > probe huggingface.co then
  hf-mirror.com with a short timeout. ``HF_ENDPOINT`` is frozen when huggingface_hub is imported, so the chosen
  URL is always passed explicitly as ``endpoint=``.
* One commit for the whole download: the repo info (with file sizes and LFS sha256) is fetched once, with a
  timeout, and ``snapshot_download`` is called with that commit id. Retries then never mix two commits, the
  listing doubles as the verification manifest, and ``refs/<revision>`` is written so offline loading by repo id
  still works.
* Retries (tenacity) with exponential backoff and jitter on timeouts, dropped/refused connections, 5xx and 429
  (``Retry-After`` honoured). 401/403/404 and the hub's not-found/gated errors are never retried: they become a
  ``HubError`` that says how to log in. Files completed by an attempt stay in the cache and are not fetched again.
* Resume inside a transfer. huggingface_hub 1.x writes each file to a process-unique ``*.incomplete`` temp file
  and deletes it when the download fails, so nothing survives from one ``snapshot_download`` call to the next;
  its own in-call resume only covers a clean early close, and only at 10 MiB chunk boundaries (httpx keeps the
  partial chunk in memory and loses it with the exception). So, while ``download`` runs, huggingface_hub's
  shared httpx client is replaced by one that (1) caps every timeout (some of its calls have none) and (2) when a
  response body breaks off, re-requests the remainder with ``Range``/``If-Range`` and splices it into the same
  stream: huggingface_hub never sees the break and no byte already received is fetched again. (Files stored on
  Xet are fetched by ``hf_xet``, which has its own retries and chunk cache; this applies to plain HTTP.)
* Cache hygiene: lock files left by dead processes are removed; a lock held by a live process is waited for,
  then ``BusyError``. Orphaned temp files are removed (they can never be resumed, see above).
* Verification: every listed file present with the listed size, LFS files with the listed sha256, every shard of
  a ``*.safetensors.index.json`` present, and no ``*.incomplete`` left.

Importing this module is cheap: huggingface_hub, httpx and tenacity are imported inside the functions.
Tokens are passed through to huggingface_hub and never appear in results, messages or logs.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ftlaunch.errors import BusyError, ConfigError, FtlaunchError, HubError, NetworkError, VerifyError

log = logging.getLogger(__name__)

KNOWN_ENDPOINTS: dict[str, str] = {"hf": "https://huggingface.co", "hf-mirror": "https://hf-mirror.com"}
MODELSCOPE = "modelscope"  # handled separately: downloaded by the modelscope package, not huggingface_hub
DEFAULT_CANDIDATES: tuple[str, ...] = ("hf", "hf-mirror")

# Cap on a server's Retry-After, so a bogus header cannot stall a run for hours.
MAX_RETRY_AFTER_S = 300.0
# Consecutive in-stream resumes without receiving a byte before the transfer error is let through.
MAX_STREAM_RESUMES = 5
_LOGIN_HOWTO = "log in with `hf auth login` or set HF_TOKEN"
_TOKEN_LIKE = re.compile(r"hf_[A-Za-z0-9]{20,}")  # the shape of HF access tokens


# =============================================================================================== endpoint choice
@dataclass(frozen=True)
class EndpointChoice:
    name: str
    url: str | None  # None for ModelScope
    reason: str
    use_modelscope: bool = False


def choose_endpoint(
    repo_id: str,
    mirror: str | None,
    env: Mapping[str, str],
    *,
    probe: Callable[[str, str], bool] | None = None,
    timeout: float = 3.0,
    candidates: Sequence[str | tuple[str, str]] = DEFAULT_CANDIDATES,
    repo_type: str = "model",
) -> EndpointChoice:
    """Decide where to download ``repo_id`` from.

    Precedence: an explicit ``mirror`` ("hf", "hf-mirror", "modelscope" or an http(s) URL) > ``HF_ENDPOINT`` in
    ``env`` > ``USE_MODELSCOPE_HUB`` (LLaMA-Factory's switch) > probing ``candidates`` in order (names of
    ``KNOWN_ENDPOINTS`` or ``(name, url)`` pairs) and taking the first that answers. ``mirror=None`` means "auto".

    The default probe is ``GET {url}/api/models/{repo_id}`` (``/api/datasets/...`` for ``repo_type="dataset"``)
    without a token (a token is never sent to an endpoint that was not chosen). Any HTTP answer below 500 counts
    as "answers": 200 is there, 401/403 is private or gated (the download will say how to log in), 404 is
    reachable but missing (the download will report the wrong repo id from the endpoint that answered, rather
    than trying further mirrors). Timeouts, refused connections and 5xx do not count. ``probe(url, repo_id) ->
    bool`` replaces it (tests, custom checks).
    If nothing answers, the first candidate is returned anyway: the download has its own retries.
    """
    choice = (mirror or "auto").strip()
    if choice.lower() != "auto":
        return _explicit_endpoint(choice)

    hf_endpoint = (env.get("HF_ENDPOINT") or "").strip()
    if hf_endpoint:
        url = _check_url(hf_endpoint, what="HF_ENDPOINT")
        return EndpointChoice(_name_for_url(url), url, f"HF_ENDPOINT is set ({url})")
    if _truthy(env.get("USE_MODELSCOPE_HUB")):
        return EndpointChoice(MODELSCOPE, None, "USE_MODELSCOPE_HUB is set", use_modelscope=True)

    resolved = [_candidate(c) for c in candidates]
    if not resolved:
        raise ConfigError("no endpoint candidates to probe")
    if _truthy(env.get("HF_HUB_OFFLINE")):
        name, url = resolved[0]
        return EndpointChoice(name, url, f"HF_HUB_OFFLINE is set: not probing; using {_host(url)}")

    notes: list[str] = []
    for name, url in resolved:
        if probe is not None:
            answered = bool(probe(url, repo_id))
            detail = "answered" if answered else "did not answer"
        else:
            answered, detail = _http_probe(url, repo_id, timeout, repo_type)
        notes.append(f"{_host(url)} {detail}")
        if answered:
            return EndpointChoice(name, url, "; ".join(notes))
    name, url = resolved[0]
    return EndpointChoice(
        name, url, f"no endpoint answered ({'; '.join(notes)}); using {_host(url)} and relying on retries"
    )


def _explicit_endpoint(choice: str) -> EndpointChoice:
    key = choice.lower()
    if key == MODELSCOPE:
        return EndpointChoice(MODELSCOPE, None, "--mirror modelscope", use_modelscope=True)
    if key in KNOWN_ENDPOINTS:
        return EndpointChoice(key, KNOWN_ENDPOINTS[key], f"--mirror {key}")
    if key.startswith(("http://", "https://")):
        url = _check_url(choice, what="--mirror")
        return EndpointChoice(_name_for_url(url), url, f"--mirror {url}")
    raise ConfigError(
        f"unknown mirror {choice!r}",
        hint="use auto, hf, hf-mirror, modelscope or an http(s):// URL of a hub-compatible endpoint",
    )


def _candidate(c: str | tuple[str, str]) -> tuple[str, str]:
    if isinstance(c, tuple):
        return c[0], _check_url(c[1], what=f"candidate {c[0]}")
    if c not in KNOWN_ENDPOINTS:
        raise ConfigError(f"unknown endpoint candidate {c!r}", hint=f"known: {', '.join(KNOWN_ENDPOINTS)}")
    return c, KNOWN_ENDPOINTS[c]


def _check_url(url: str, *, what: str) -> str:
    parsed = urlparse(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"{what} must be an http(s) URL, got {url!r}")
    return url.strip().rstrip("/")


def _name_for_url(url: str) -> str:
    for name, known in KNOWN_ENDPOINTS.items():
        if known == url:
            return name
    return "custom"


def _host(url: str) -> str:
    return urlparse(url).netloc or url


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _http_probe(url: str, repo_id: str, timeout: float, repo_type: str = "model") -> tuple[bool, str]:
    import httpx

    api = f"{url}/api/{repo_type}s/{repo_id}"  # the hub's repo info URL: /api/models/..., /api/datasets/...

    try:
        # trust_env keeps HTTPS_PROXY working: where huggingface.co is blocked, a proxy is the other usual fix.
        with httpx.Client(timeout=timeout, follow_redirects=True, trust_env=True) as client:
            status = client.get(api).status_code
    except httpx.TimeoutException:
        return False, f"did not answer in {timeout:g}s"
    except httpx.ConnectError as exc:
        return False, f"could not be reached ({_first_line(exc) or 'connection failed'})"
    except httpx.HTTPError as exc:
        return False, f"failed ({type(exc).__name__})"
    if status >= 500:
        return False, f"answered {status}"
    if status == 404:
        return True, "answered 404 (reachable, repo not found there)"
    return True, f"answered {status}"


# =============================================================================================== results
@dataclass(frozen=True)
class DownloadResult:
    repo_id: str
    path: str  # the snapshot folder, usable as model_name_or_path
    endpoint: str
    revision: str | None  # as requested (None: the default branch)
    files: int
    bytes: int
    retries: int  # whole-attempt retries made by download()
    commit: str | None = None  # the commit actually downloaded
    resumes: int = 0  # broken transfers continued in place with a Range request
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


ExpectedFile = tuple[str, int | None, str | None]  # (rfilename, size, sha256 for LFS files)


# =============================================================================================== locks
def lock_is_held(path: Path) -> bool:
    """True if some process holds the flock on ``path`` (how huggingface_hub's filelock locks).

    A lock file whose flock can be taken without blocking is not held by anyone: its owner died or finished.
    Where flock cannot be probed (no fcntl, or a filesystem without flock), report "held" to stay on the safe
    side; filelock's soft-lock fallback recovers stale locks of dead processes by itself there.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return True
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _remove_if_free(path: Path) -> bool:
    """Unlink ``path`` while holding its flock, so a process that is just taking it is never raced."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        # filelock (4.x) re-checks the inode after acquiring, so unlinking under our flock is safe for waiters.
        try:
            path.unlink()
        except OSError:
            return False
        return True
    finally:
        os.close(fd)  # releases the flock


def clear_stale_locks(cache_dir: Path, *, is_alive: Callable[[Path], bool] = lock_is_held) -> list[Path]:
    """Remove ``.locks/**/*.lock`` files in the hub cache whose holder is gone; return the removed paths.

    ``is_alive(lock_path)`` says whether the lock is held by a live process; by default its flock is probed
    (and the removal itself happens under that flock).
    """
    locks_dir = Path(cache_dir) / ".locks"
    if not locks_dir.is_dir():
        return []
    removed: list[Path] = []
    for lock in sorted(locks_dir.rglob("*.lock")):
        if is_alive is lock_is_held:
            if _remove_if_free(lock):
                removed.append(lock)
        elif not is_alive(lock):
            try:
                lock.unlink()
                removed.append(lock)
            except OSError:
                pass
    if removed:
        log.info("removed %d stale lock file(s) under %s", len(removed), locks_dir)
    return removed


def _wait_for_locks(
    lock_dir: Path, repo_id: str, *, timeout: float, is_alive: Callable[[Path], bool], sleep: Callable[[float], None]
) -> None:
    """Wait until no live process holds a lock of this repo; BusyError after ``timeout`` seconds.

    huggingface_hub itself would wait forever on such a lock, without a word. Time is counted from the requested
    sleeps (not the clock) so tests with an instant ``sleep`` stay deterministic.
    """
    interval = 0.5
    waited = 0.0
    announced = False
    while True:
        held = [p for p in sorted(lock_dir.glob("*.lock")) if is_alive(p)] if lock_dir.is_dir() else []
        if not held:
            return
        if waited >= timeout:
            raise BusyError(
                f"another process is downloading {repo_id} into this cache (it holds {held[0]}); waited {waited:g}s",
                hint="wait for the other download to finish and run again, or use a different cache_dir",
            )
        if not announced:
            log.warning("another process holds a download lock of %s; waiting up to %gs", repo_id, timeout)
            announced = True
        sleep(interval)
        waited += interval


_UNIQUE_PARTIAL = re.compile(r"^(?P<etag>[^.]+)\.[0-9a-f]{8}\.incomplete$")
_LEGACY_PARTIAL = re.compile(r"^(?P<etag>[^.]+)\.incomplete$")


def _sweep_partials(storage: Path, lock_dir: Path, is_alive: Callable[[Path], bool]) -> list[Path]:
    """Remove ``blobs/*.incomplete`` files that nobody is writing and nobody can resume.

    huggingface_hub 1.x names its temp files ``<etag>.<8 hex>.incomplete``, unique per download, and never reads
    one back: any such file whose lock is free was left by a killed process. Older versions resume from
    ``<etag>.incomplete``, so that name is only removed once the finished blob exists.
    """
    blobs = storage / "blobs"
    if not blobs.is_dir():
        return []
    removed: list[Path] = []
    for partial in sorted(blobs.glob("*.incomplete")):
        m = _UNIQUE_PARTIAL.match(partial.name) or _LEGACY_PARTIAL.match(partial.name)
        if m is None:
            continue
        etag = m.group("etag")
        if is_alive(lock_dir / f"{etag}.lock"):
            continue  # a live download is writing it
        unique = _UNIQUE_PARTIAL.match(partial.name) is not None
        if unique or (blobs / etag).exists():
            try:
                partial.unlink()
                removed.append(partial)
            except OSError:  # gone already, or a read-only shared cache: leave it
                pass
    return removed


# =============================================================================================== verification
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
            weight_map = json.loads(index.read_text())["weight_map"]
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


# =============================================================================================== environment
def offline_env(snapshot_path: str | Path) -> dict[str, str]:
    """Environment for the training process once the snapshot is on disk: no hub traffic at all.

    Pass ``snapshot_path`` itself as ``model_name_or_path``; then nothing needs the network (or the cache layout).
    """
    del snapshot_path  # the variables do not depend on it; kept in the signature for the caller's clarity
    return {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


# =============================================================================================== download
def download(
    repo_id: str,
    *,
    endpoint: str,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    token: str | bool | None = None,
    max_attempts: int = 6,
    timeout: float = 10.0,
    progress: bool = True,
    on_retry: Callable[[int, int, BaseException, float], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    allow_patterns: str | list[str] | None = None,
    ignore_patterns: str | list[str] | None = None,
    repo_type: str = "model",
    verify: bool = True,
    lock_timeout: float = 300.0,
) -> DownloadResult:
    """Download a repo snapshot into the hub cache, resuming and retrying, then verify it.

    ``endpoint``: a URL, a ``KNOWN_ENDPOINTS`` name, or "modelscope". ``timeout``: seconds a silent server is
    tolerated (per connect/read). ``on_retry(n, max_retries, exc, wait_s)`` is called before the n-th retry
    (``max_retries = max_attempts - 1``). ``sleep`` performs the backoff waits (tests pass a no-op).
    Raises HubError (refused: missing, private, gated), NetworkError (still failing after ``max_attempts``),
    VerifyError (bad files are removed so the next call fetches them again), BusyError (a live process holds a
    download lock of this repo for longer than ``lock_timeout``).
    """
    if max_attempts < 1:
        raise ValueError("max_attempts must be >= 1")
    started = time.monotonic()
    url = _resolve_endpoint(endpoint)
    if url is None:
        return _download_modelscope(repo_id, revision=revision, cache_dir=cache_dir, started=started)

    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.utils import disable_progress_bars, filter_repo_objects

    from ftlaunch import __version__

    cache = Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE).expanduser().resolve()
    folder = f"{repo_type}s--{repo_id.replace('/', '--')}"
    storage = cache / folder
    lock_dir = cache / ".locks" / folder

    clear_stale_locks(cache)
    _wait_for_locks(lock_dir, repo_id, timeout=lock_timeout, is_alive=lock_is_held, sleep=sleep)
    _sweep_partials(storage, lock_dir, lock_is_held)

    api = HfApi(endpoint=url, token=token, library_name="ftlaunch", library_version=__version__)
    stats = _StreamStats()
    state: dict[str, Any] = {}
    max_retries = max_attempts - 1

    def attempt() -> str:
        if "info" not in state:
            # One listing per download: it pins the commit and is the verification manifest.
            state["info"] = api.repo_info(
                repo_id, repo_type=repo_type, revision=revision, files_metadata=True, timeout=timeout
            )
        commit = getattr(state["info"], "sha", None)
        return snapshot_download(
            repo_id,
            repo_type=repo_type,
            revision=commit or revision,
            cache_dir=str(cache),
            endpoint=url,
            etag_timeout=timeout,
            token=token,
            allow_patterns=allow_patterns,
            ignore_patterns=ignore_patterns,
            library_name="ftlaunch",
            library_version=__version__,
        )

    retries = 0

    def before_sleep(retry_state: Any) -> None:
        nonlocal retries
        retries = retry_state.attempt_number
        exc = retry_state.outcome.exception()
        wait = retry_state.next_action.sleep if retry_state.next_action is not None else 0.0
        # With on_retry the caller reports retries itself; otherwise make sure they are not silent.
        log.log(
            logging.INFO if on_retry is not None else logging.WARNING,
            "[%d/%d] download of %s failed (%s); retrying in %.1fs",
            retries,
            max_retries,
            repo_id,
            _describe(exc, token, timeout),
            wait,
        )
        if on_retry is not None:
            on_retry(retries, max_retries, exc, wait)

    progress_cm = nullcontext() if progress else disable_progress_bars()
    try:
        with progress_cm, _resilient_hf_client(timeout, stats):
            path_str = _retrying(attempt, max_attempts=max_attempts, sleep=sleep, before_sleep=before_sleep)
    except BaseException as exc:
        translated = _translate_error(
            exc, repo_id=repo_id, url=url, revision=revision, token=token, attempts=retries + 1, timeout=timeout
        )
        if translated is None:
            raise
        raise translated from exc

    info = state["info"]
    commit = getattr(info, "sha", None)
    snapshot = Path(path_str)
    if commit and revision != commit:
        _write_ref(storage, revision or "main", commit)
    _sweep_partials(storage, lock_dir, lock_is_held)

    siblings = [s for s in (getattr(info, "siblings", None) or [])]
    wanted = set(
        filter_repo_objects(
            [s.rfilename for s in siblings], allow_patterns=allow_patterns, ignore_patterns=ignore_patterns
        )
    )
    expected: list[ExpectedFile] = [
        (s.rfilename, s.size, s.lfs.sha256 if s.lfs is not None else None) for s in siblings if s.rfilename in wanted
    ]
    if verify:
        problems = _check_snapshot(snapshot, expected)
        if problems:
            bad = sorted({name for name, _ in problems if name is not None})
            _quarantine(snapshot, bad)
            hint = (
                "the bad files were removed from the cache; run again to re-download them. If it keeps failing, "
                "the endpoint serves damaged files: try another mirror (--mirror hf / hf-mirror)"
                if bad
                else "run the download again"
            )
            raise _verify_error(snapshot, [p for _, p in problems], hint=hint)

    return DownloadResult(
        repo_id=repo_id,
        path=str(snapshot),
        endpoint=url,
        revision=revision,
        files=len(expected),
        bytes=sum(size or 0 for _, size, _ in expected),
        retries=retries,
        commit=commit,
        resumes=stats.resumes,
        seconds=round(time.monotonic() - started, 3),
    )


def _resolve_endpoint(endpoint: str) -> str | None:
    key = endpoint.strip()
    if key.lower() == MODELSCOPE:
        return None
    if key.lower() in KNOWN_ENDPOINTS:
        return KNOWN_ENDPOINTS[key.lower()]
    return _check_url(key, what="endpoint")


def _write_ref(storage: Path, revision: str, commit: str) -> None:
    """refs/<revision> -> commit, as snapshot_download would have written had it resolved the revision itself;
    offline loading by repo id (HF_HUB_OFFLINE=1) needs it."""
    ref = storage / "refs" / revision
    try:
        if ref.is_file() and ref.read_text() == commit:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f"{ref.name}.{os.getpid()}.tmp")
        tmp.write_text(commit)
        os.replace(tmp, ref)  # atomic: a concurrent reader never sees a half-written ref
    except OSError as exc:
        log.warning("could not write %s: %s", ref, exc)


def _retrying(
    fn: Callable[[], str],
    *,
    max_attempts: int,
    sleep: Callable[[float], None],
    before_sleep: Callable[[Any], None],
) -> str:
    from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

    backoff = wait_exponential_jitter(initial=1, max=60, exp_base=2, jitter=1)

    def wait(retry_state: Any) -> float:
        retry_after = _retry_after(retry_state.outcome.exception())
        return retry_after if retry_after is not None else backoff(retry_state)

    retrying = Retrying(
        stop=stop_after_attempt(max_attempts),
        retry=retry_if_exception(_is_retryable),
        wait=wait,
        sleep=sleep,
        before_sleep=before_sleep,
        reraise=True,
    )
    return retrying(fn)


# =============================================================================================== error handling
def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """The exception and its causes: snapshot_download wraps the HTTP error in LocalEntryNotFoundError."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def _refusal(exc: BaseException) -> BaseException | None:
    """The hub's 'no' (missing, private, gated, wrong revision/file): retrying cannot help."""
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    refusals = (
        RepositoryNotFoundError,
        GatedRepoError,
        RevisionNotFoundError,
        RemoteEntryNotFoundError,
        DisabledRepoError,
    )
    for e in _chain(exc):
        if isinstance(e, refusals):
            return e
        if isinstance(e, HfHubHTTPError) and _status(e) in (401, 403, 404):
            return e
    return None


def _is_retryable(exc: BaseException) -> bool:
    import httpx
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    if _refusal(exc) is not None:
        return False
    for e in _chain(exc):
        if isinstance(e, OfflineModeIsEnabled):
            return False
        if isinstance(e, (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError, TimeoutError)):
            return True
        if isinstance(e, ConnectionError):  # resets/refusals seen as plain OSErrors
            return True
        if isinstance(e, HfHubHTTPError):
            status = _status(e)
            return status is not None and (status >= 500 or status in (408, 429))
        if isinstance(e, OSError) and "Consistency check failed" in str(e):
            return True  # huggingface_hub: the body was shorter/longer than announced
    # "cannot reach the hub and nothing cached" with no further cause: a connectivity problem.
    return isinstance(exc, LocalEntryNotFoundError)


def _retry_after(exc: BaseException | None) -> float | None:
    for e in _chain(exc):
        response = getattr(e, "response", None)
        headers = getattr(response, "headers", None)
        value = headers.get("Retry-After") if headers is not None else None
        if value and value.strip().isdigit():
            return min(float(value.strip()), MAX_RETRY_AFTER_S)
    return None


def _translate_error(
    exc: BaseException,
    *,
    repo_id: str,
    url: str,
    revision: str | None,
    token: str | bool | None,
    attempts: int,
    timeout: float,
) -> FtlaunchError | None:
    """Map a failure to the ftlaunch error the CLI reports; None: not ours to translate (re-raise as is)."""
    from huggingface_hub.errors import (
        GatedRepoError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, FtlaunchError):
        return None
    if not isinstance(exc, Exception):
        return None  # KeyboardInterrupt and friends
    from huggingface_hub.errors import HFValidationError

    if isinstance(exc, HFValidationError):
        return HubError(
            f"{repo_id!r} is not a valid repo id: {_redact(_first_line(exc), token)}",
            hint="repo ids look like 'Qwen/Qwen2.5-0.5B-Instruct' (case-sensitive)",
        )
    host = _host(url)
    refusal = _refusal(exc)
    if refusal is not None:
        status = _status(refusal)
        if isinstance(refusal, RevisionNotFoundError):
            return HubError(
                f"revision {revision!r} of {repo_id} was not found on {host}",
                hint="check the revision (branch, tag or commit id); omit it for the default branch",
            )
        if isinstance(refusal, RemoteEntryNotFoundError):
            return HubError(
                f"{host} lists a file of {repo_id} that it then does not serve (HTTP 404)",
                hint="the mirror may be out of date: try another one (--mirror hf / hf-mirror)",
            )
        if isinstance(refusal, GatedRepoError) or status == 403:
            return HubError(
                f"{repo_id} is gated or your token may not read it (HTTP {status or 403} from {host}): "
                f"accept its terms on the model page, then {_LOGIN_HOWTO} with a token that has read access",
                hint=f"open https://huggingface.co/{repo_id} to request access; check the repo id if unsure",
            )
        if status == 401:
            return HubError(
                f"{host} refused {repo_id} (HTTP 401: private or gated, and not logged in or the token is invalid): "
                f"{_LOGIN_HOWTO}, or check the repo id",
                hint="repo ids look like 'Qwen/Qwen2.5-0.5B-Instruct' (case-sensitive)",
            )
        return HubError(
            f"{repo_id} was not found on {host} (HTTP {status or 404}): check the repo id; if the repo is private "
            f"or gated, {_LOGIN_HOWTO}",
            hint="repo ids look like 'Qwen/Qwen2.5-0.5B-Instruct' (case-sensitive)",
        )
    for e in _chain(exc):
        if isinstance(e, OfflineModeIsEnabled):
            return NetworkError(
                f"cannot download {repo_id}: offline mode is on (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE)",
                hint="unset HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE to download, or point to a local model path",
            )
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return FtlaunchError(
                f"no space left on the device while downloading {repo_id}",
                hint="free disk space or choose another cache_dir (HF_HOME / HF_HUB_CACHE)",
            )
    if _is_retryable(exc):
        return NetworkError(
            f"download of {repo_id} from {host} failed after {attempts} attempt(s): {_describe(exc, token, timeout)}",
            hint="check the connection or try another mirror (--mirror hf-mirror, or HF_ENDPOINT); files already "
            "downloaded stay in the cache and are not fetched again",
        )
    return None


def _describe(exc: BaseException | None, token: str | bool | None, timeout: float) -> str:
    """One short line about a failure, with the token scrubbed."""
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    if exc is None:
        return "unknown error"
    text = f"{type(exc).__name__}: {_first_line(exc)}"
    for e in _chain(exc):
        if isinstance(e, HfHubHTTPError) and _status(e) is not None:
            text = f"HTTP {_status(e)}"
            break
        if isinstance(e, httpx.TimeoutException):
            text = f"no answer within {timeout:g}s ({type(e).__name__})"
            break
        if isinstance(e, (httpx.NetworkError, httpx.RemoteProtocolError, ConnectionError)):
            text = f"connection problem ({type(e).__name__}: {_first_line(e)})"
            break
    return _redact(text, token)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""


def _redact(text: str, token: str | bool | None) -> str:
    if isinstance(token, str) and token:
        text = text.replace(token, "***")
    return _TOKEN_LIKE.sub("hf_***", text)


# =============================================================================================== resilient client
class _StreamStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.resumes = 0

    def resumed(self) -> None:
        with self._lock:
            self.resumes += 1


@contextmanager
def _resilient_hf_client(timeout: float, stats: _StreamStats) -> Iterator[None]:
    """Make huggingface_hub use a client with capped timeouts and in-stream resume, for this block only.

    huggingface_hub's public ``set_client_factory`` is the hook; the previous factory (a private attribute) is
    put back afterwards. Should that attribute ever go away, huggingface_hub's own client is left alone.
    """
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http as hf_http

    previous = getattr(hf_http, "_GLOBAL_CLIENT_FACTORY", None)
    if previous is None:
        yield
        return
    client_cls = _client_class()

    def factory() -> Any:
        base = previous()  # keeps huggingface_hub's own request hooks (offline mode, request ids)
        try:
            hooks, follow, trust_env = base.event_hooks, base.follow_redirects, base.trust_env
        finally:
            base.close()
        return client_cls(
            cap=timeout, stats=stats, event_hooks=hooks, follow_redirects=follow, trust_env=trust_env, timeout=None
        )

    set_client_factory(factory)
    try:
        yield
    finally:
        set_client_factory(previous)


_CLIENT_CLASS: Any = None


def _client_class() -> Any:
    """Build the httpx subclasses on first use, so importing ftlaunch.hub does not import httpx."""
    global _CLIENT_CLASS
    if _CLIENT_CLASS is not None:
        return _CLIENT_CLASS
    import httpx

    resumable = (httpx.ReadError, httpx.RemoteProtocolError, httpx.ReadTimeout)

    def as_hang_up(exc: Exception) -> Exception:
        """httpx reports a reset connection as ReadError and an early close as RemoteProtocolError;
        huggingface_hub's http_get resumes (in-call, with Range) only on the latter: present both the same way."""
        if isinstance(exc, httpx.ReadError):
            return httpx.RemoteProtocolError(f"connection reset: {exc}", request=getattr(exc, "_request", None))
        return exc

    content_range = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$")

    class ResumingStream(httpx.SyncByteStream):
        """A response body that survives broken connections by re-requesting the rest with Range."""

        def __init__(self, client: ResilientClient, response: httpx.Response, start: int, end: int) -> None:
            self._client = client
            self._request = response.request
            self._inner = response.stream
            self._next = start  # absolute offset of the next byte
            self._end = end  # absolute offset of the last byte
            etag = response.headers.get("ETag")
            # If-Range makes the server send the whole (new) file rather than a tail of a changed one.
            self._validator = etag if etag and not etag.startswith("W/") else response.headers.get("Last-Modified")

        def __iter__(self) -> Iterator[bytes]:
            stream: Any = self._inner
            stalled = 0  # consecutive breaks without a single new byte
            while True:
                progressed = False
                try:
                    for chunk in stream:
                        if chunk:
                            progressed = True
                            self._next += len(chunk)
                        yield chunk
                    return
                except resumable as exc:
                    if self._next > self._end:
                        return
                    stalled = 0 if progressed else stalled + 1
                    if stalled >= MAX_STREAM_RESUMES:
                        raise as_hang_up(exc) from exc
                    stream = self._reopen(exc)

        def _reopen(self, error: Exception) -> Any:
            headers = self._request.headers.copy()
            headers["Range"] = f"bytes={self._next}-{self._end}"
            if self._validator:
                headers["If-Range"] = self._validator
            for n in range(MAX_STREAM_RESUMES):
                time.sleep(min(0.25 * (2**n) - 0.25, 4.0))  # 0, 0.25, 0.75, 1.75, 3.75 s
                request = httpx.Request(
                    self._request.method, self._request.url, headers=headers, extensions=dict(self._request.extensions)
                )
                try:
                    response = self._client.send_plain(request)
                except httpx.TransportError:
                    continue  # server still away: wait a bit longer and ask again
                match = content_range.match(response.headers.get("Content-Range", ""))
                if response.status_code != 206 or match is None or int(match.group(1)) != self._next:
                    # No usable range (the file changed, or the server ignores Range): let the caller's own
                    # recovery (huggingface_hub, then download()'s retries) deal with the original error.
                    response.close()
                    raise as_hang_up(error) from error
                self._close_inner()
                self._inner = response.stream
                self._client.stats.resumed()
                log.info("resumed %s at byte %d after %s", self._request.url, self._next, type(error).__name__)
                return self._inner
            raise as_hang_up(error) from error

        def _close_inner(self) -> None:
            try:
                self._inner.close()
            except Exception:  # noqa: BLE001 - a broken connection may fail to close; it is dropped anyway
                pass

        def close(self) -> None:
            self._close_inner()

    class HangUpStream(httpx.SyncByteStream):
        """A body that cannot be resumed here (no range support): only make resets look like early closes."""

        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __iter__(self) -> Iterator[bytes]:
            try:
                yield from self._inner
            except httpx.ReadError as exc:
                raise as_hang_up(exc) from exc

        def close(self) -> None:
            self._inner.close()

    class ResilientClient(httpx.Client):
        def __init__(self, *, cap: float, stats: _StreamStats, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.cap = cap
            self.stats = stats

        def send_plain(self, request: httpx.Request) -> httpx.Response:
            return super().send(request, stream=True)

        def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:  # type: ignore[override]
            # Some huggingface_hub calls (repo tree listing, ...) pass timeout=None: a stalled server would hang
            # the run forever. Every phase gets at most `cap` seconds.
            limits = dict(request.extensions.get("timeout") or {})
            for phase in ("connect", "read", "write", "pool"):
                value = limits.get(phase)
                if value is None or value > self.cap:
                    limits[phase] = self.cap
            request.extensions = {**request.extensions, "timeout": limits}
            try:
                response = super().send(request, **kwargs)
            except httpx.ReadError as exc:
                raise as_hang_up(exc) from exc
            if kwargs.get("stream") and request.method == "GET":
                span = _resumable_span(response, content_range)
                if span is not None:
                    response.stream = ResumingStream(self, response, *span)
                else:
                    response.stream = HangUpStream(response.stream)
            return response

    _CLIENT_CLASS = ResilientClient
    return _CLIENT_CLASS


def _resumable_span(response: Any, content_range: re.Pattern[str]) -> tuple[int, int] | None:
    """(first, last) byte offsets of a body that can be continued with a Range request, else None."""
    if response.status_code not in (200, 206):
        return None
    if response.headers.get("Content-Encoding", "identity").lower() != "identity":
        return None  # offsets of a compressed body are not file offsets
    length = response.headers.get("Content-Length")
    if length is None or not length.isdigit() or int(length) == 0:
        return None
    if response.status_code == 206:
        match = content_range.match(response.headers.get("Content-Range", ""))
        if match is None:
            return None
        return int(match.group(1)), int(match.group(2))
    if response.headers.get("Accept-Ranges", "").lower() != "bytes":
        return None
    return 0, int(length) - 1


# =============================================================================================== modelscope
_MODELSCOPE_CHILD = """
import json, sys
args = json.loads(sys.argv[1])
from modelscope import snapshot_download
print("FTLAUNCH_PATH=" + snapshot_download(args["repo_id"], revision=args["revision"], cache_dir=args["cache_dir"]))
"""


def _download_modelscope(
    repo_id: str, *, revision: str | None, cache_dir: str | Path | None, started: float
) -> DownloadResult:
    """Delegate to ``modelscope.snapshot_download`` in a child process: importing modelscope imports torch,
    which ftlaunch's own process never does."""
    if importlib.util.find_spec("modelscope") is None:
        raise HubError(
            "ModelScope was chosen as the download source but the 'modelscope' package is not installed",
            hint="pip install modelscope, or choose another mirror (--mirror hf-mirror / hf)",
        )
    args = {"repo_id": repo_id, "revision": revision, "cache_dir": str(cache_dir) if cache_dir else None}
    proc = subprocess.run(
        [sys.executable, "-c", _MODELSCOPE_CHILD, json.dumps(args)],
        stdout=subprocess.PIPE,  # stderr is inherited: modelscope's progress and errors reach the user directly
        text=True,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FTLAUNCH_PATH=")]
    if proc.returncode != 0 or not lines:
        raise NetworkError(
            f"ModelScope download of {repo_id} failed (exit {proc.returncode}); its output is above",
            hint="check the model id on modelscope.cn, or choose another mirror (--mirror hf-mirror / hf)",
        )
    path = Path(lines[-1].split("=", 1)[1])
    files = [p for p in path.rglob("*") if p.is_file()]
    return DownloadResult(
        repo_id=repo_id,
        path=str(path),
        endpoint=MODELSCOPE,
        revision=revision,
        files=len(files),
        bytes=sum(p.stat().st_size for p in files),
        retries=0,
        seconds=round(time.monotonic() - started, 3),
    )
