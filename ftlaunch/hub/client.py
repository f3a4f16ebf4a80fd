"""A resilient HTTP client for huggingface_hub: capped timeouts, Range-resume of broken bodies."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

# Consecutive in-stream resumes without receiving a byte before the transfer error is let through.
MAX_STREAM_RESUMES = 5


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
