"""Classifying hub failures: retryable or not, Retry-After, and errors that say how to log in."""

from __future__ import annotations

import errno
import re
from collections.abc import Iterator

from ..errors import FtlaunchError, HubError, NetworkError
from .endpoints import _first_line, _host

# Cap on a server's Retry-After, so a bogus header cannot stall a run for hours.
MAX_RETRY_AFTER_S = 300.0
_LOGIN_HOWTO = "log in with `hf auth login` or set HF_TOKEN"
_TOKEN_LIKE = re.compile(r"hf_[A-Za-z0-9]{20,}")  # the shape of HF access tokens


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


def _redact(text: str, token: str | bool | None) -> str:
    if isinstance(token, str) and token:
        text = text.replace(token, "***")
    return _TOKEN_LIKE.sub("hf_***", text)
