"""The download itself: one commit, retries with backoff, resume inside a file, then verify."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from .cache import _sweep_partials, _wait_for_locks, clear_stale_locks, lock_is_held
from .client import _resilient_hf_client, _StreamStats
from .endpoints import KNOWN_ENDPOINTS, MODELSCOPE, _check_url
from .errors import _describe, _is_retryable, _retry_after, _translate_error
from .modelscope import _download_modelscope
from .results import DownloadResult, ExpectedFile
from .verify import _check_snapshot, _quarantine, _verify_error

log = logging.getLogger(__name__)


def offline_env() -> dict[str, str]:
    """Environment for the training process once its model and datasets are on disk: no hub traffic at all
    (the one place these variables are set; pass the snapshot path itself as ``model_name_or_path``)."""
    return {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


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
