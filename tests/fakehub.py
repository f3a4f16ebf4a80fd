"""A real local HTTP server that speaks the part of the Hugging Face hub protocol that downloads use.

It serves in-memory model (and dataset) repos to the REAL ``huggingface_hub`` client (1.x, httpx based), so tests
and the download benchmark exercise the same code paths as a download from huggingface.co, with faults injected at the
HTTP level instead of mocking the client. Requests it implements, as ``snapshot_download``/``HfApi`` make them:

* ``GET /api/models/{repo}`` and ``GET /api/models/{repo}/revision/{rev}[?blobs=True]``: repo info (``sha`` and
  ``siblings``; with ``blobs=True`` each sibling carries ``size``, ``blobId`` and, for LFS files, ``lfs.sha256``).
* ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=..``: the file listing ``snapshot_download`` caches.
* ``HEAD|GET /{repo}/resolve/{rev}/{file}``: ``X-Repo-Commit`` and ``ETag`` (git blob sha1) for regular files;
  for LFS files a ``302`` to a "CDN" URL with ``X-Linked-Etag`` (sha256), ``X-Linked-Size`` and ``Location``,
  exactly like the hub. The CDN URL uses a different host name (``localhost`` vs ``127.0.0.1``, same server) so
  the client treats it as off-hub: it does not follow the HEAD redirect and does not send the token there.
* ``HEAD|GET /__cdn__/{repo}/{sha256}/{file}``: the LFS bytes, with ``Range`` (``206`` + ``Content-Range``) and
  ``If-Range`` support.

Dataset repos (``datasets=`` / ``add_repo(..., repo_type="dataset")``) are served the same way under the hub's
dataset prefixes: ``/api/datasets/{repo}...`` and ``/datasets/{repo}/resolve/{rev}/{file}``.

It never advertises Xet (no ``X-Xet-Hash`` header, no ``xetHash`` in the tree), so the client uses plain HTTP.

Faults: ``fail_next`` (an HTTP status, optionally with ``Retry-After``), ``drop_after`` (send the full
``Content-Length`` then hang up after n body bytes, with a FIN or a RST), ``delay`` (stall before answering, to
make the client time out), ``status_for_repo`` (401/403/404 for everything about a repo) and ``corrupt`` (serve
different bytes of the same size while the metadata keeps the original sha256).

Fault globs are matched with ``fnmatch`` against the unquoted URL path, e.g. ``"/api/models/*"`` or
``"*model.safetensors"`` (the latter matches the ``resolve`` URL and the CDN URL of that file).
``bytes_served`` is keyed by ``"{repo_id}/{filename}"``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import socket
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".model")
CDN_PREFIX = "/__cdn__/"
_FLIP = bytes(255 - i for i in range(256))  # byte translation table used by corrupt(): same size, other bytes


def git_blob_sha1(content: bytes) -> str:
    """The git object id of a blob, which is what the hub uses as ETag for regular (non-LFS) files."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass(frozen=True)
class FakeFile:
    path: str
    content: bytes
    lfs: bool
    sha256: str
    blob_id: str  # git oid of what git stores: the content, or the LFS pointer for LFS files

    @property
    def size(self) -> int:
        return len(self.content)


@dataclass(frozen=True)
class FakeRepo:
    repo_id: str
    files: Mapping[str, FakeFile]
    commit: str
    refs: Mapping[str, str]
    repo_type: str = "model"


@dataclass(frozen=True)
class RequestRecord:
    """One request as the server saw it; ``headers`` has lower-case names."""

    method: str
    path: str
    query: str
    headers: Mapping[str, str]
    status: int
    body_bytes: int

    @property
    def range(self) -> str | None:
        return self.headers.get("range")


@dataclass
class _Fault:
    kind: str  # "status" | "drop" | "delay"
    glob: str
    method: str | None
    remaining: int | None  # None = forever
    status: int = 503
    retry_after: float | None = None
    nbytes: int = 0
    reset: bool = False
    seconds: float = 0.0

    def matches(self, method: str, path: str) -> bool:
        if self.remaining is not None and self.remaining <= 0:
            return False
        if self.method is not None and self.method.upper() != method:
            return False
        return fnmatch.fnmatchcase(path, self.glob)


@dataclass
class _Stats:
    requests: list[RequestRecord] = field(default_factory=list)
    bytes_served: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def _is_lfs_default(path: str, content: bytes) -> bool:
    return path.endswith(LFS_SUFFIXES) or len(content) >= 10 * 1024 * 1024


class FakeHub:
    """Serve ``repos`` ({repo_id: {path: bytes}}) over HTTP on 127.0.0.1; use as a context manager."""

    def __init__(
        self,
        repos: Mapping[str, Mapping[str, bytes]] | None = None,
        *,
        datasets: Mapping[str, Mapping[str, bytes]] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        cdn_host: str | None = "localhost",
        is_lfs: Callable[[str, bytes], bool] = _is_lfs_default,
        chunk_size: int = 64 * 1024,
        ranges: bool = True,
    ):
        self._host = host
        self._port = port
        self.cdn_host = cdn_host  # None: serve LFS files directly from /resolve (no redirect)
        self._is_lfs = is_lfs
        self.chunk_size = chunk_size
        self.ranges = ranges  # False: ignore Range and do not advertise Accept-Ranges (some proxies/mirrors)
        self.repos: dict[str, FakeRepo] = {}
        self.datasets: dict[str, FakeRepo] = {}
        for repo_id, files in (repos or {}).items():
            self.add_repo(repo_id, files)
        for repo_id, files in (datasets or {}).items():
            self.add_repo(repo_id, files, repo_type="dataset")
        self._lock = threading.Lock()
        self._faults: list[_Fault] = []
        self._repo_status: dict[str, tuple[int, str | None]] = {}
        self._corrupt: set[str] = set()
        self._stats = _Stats()
        # Requests being answered right now. The client can see a response before the handler thread has
        # recorded it, so readers of requests/bytes_served wait for this to drop to zero.
        self._in_flight = 0
        self._idle = threading.Condition(self._lock)
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------------------------------------- lifecycle
    def add_repo(self, repo_id: str, files: Mapping[str, bytes], *, repo_type: str = "model") -> FakeRepo:
        if repo_type not in ("model", "dataset"):
            raise ValueError(f"unsupported repo_type {repo_type!r}")
        built: dict[str, FakeFile] = {}
        for path, content in files.items():
            sha256 = hashlib.sha256(content).hexdigest()
            lfs = self._is_lfs(path, content)
            blob_id = git_blob_sha1(lfs_pointer(sha256, len(content)) if lfs else content)
            built[path] = FakeFile(path=path, content=content, lfs=lfs, sha256=sha256, blob_id=blob_id)
        # A deterministic fake commit id derived from the content, so re-creating a hub gives the same commit.
        digest = hashlib.sha1((repo_id if repo_type == "model" else f"{repo_type}s/{repo_id}").encode())
        for path in sorted(built):
            digest.update(path.encode() + b"\0" + built[path].blob_id.encode())
        commit = digest.hexdigest()
        repo = FakeRepo(repo_id=repo_id, files=built, commit=commit, refs={"main": commit}, repo_type=repo_type)
        (self.repos if repo_type == "model" else self.datasets)[repo_id] = repo
        return repo

    def _of_type(self, repo_type: str) -> dict[str, FakeRepo]:
        return self.repos if repo_type == "model" else self.datasets

    def start(self) -> FakeHub:
        hub = self

        class Handler(_HubHandler):
            fakehub = hub

        self._stopping.clear()
        self._server = _QuietServer((self._host, self._port), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="fakehub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # wakes handlers stalled by delay()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("FakeHub is not running")
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    # ----------------------------------------------------------------------------------------------- faults
    def fail_next(
        self,
        path_glob: str,
        status: int = 503,
        times: int = 1,
        retry_after: float | None = None,
        *,
        method: str | None = None,
    ) -> None:
        """Answer the next ``times`` matching requests with ``status`` (and ``Retry-After`` if given)."""
        self._add(_Fault("status", path_glob, method, times, status=status, retry_after=retry_after))

    def drop_after(
        self, path_glob: str, nbytes: int, times: int = 1, *, reset: bool = False, method: str | None = "GET"
    ) -> None:
        """Send headers with the full Content-Length, then close after ``nbytes`` of body (RST if ``reset``)."""
        self._add(_Fault("drop", path_glob, method, times, nbytes=nbytes, reset=reset))

    def delay(self, path_glob: str, seconds: float, times: int | None = None, *, method: str | None = None) -> None:
        """Stall ``seconds`` before answering matching requests (``times=None``: every one)."""
        self._add(_Fault("delay", path_glob, method, times, seconds=seconds))

    def status_for_repo(self, repo_id: str, status: int, error_code: str | None = None) -> None:
        """Answer every request about ``repo_id`` with ``status`` (the hub's X-Error-Code by default)."""
        self._repo_status[repo_id] = (status, error_code)

    def corrupt(self, path: str) -> None:
        """Serve other bytes of the same size for ``"{repo_id}/{filename}"``; metadata keeps the real sha256."""
        self._corrupt.add(path)

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()
        self._repo_status.clear()
        self._corrupt.clear()

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = _Stats()

    def _add(self, fault: _Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def _take(self, kind: str, method: str, path: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.kind == kind and fault.matches(method, path):
                    if fault.remaining is not None:
                        fault.remaining -= 1
                    return fault
        return None

    # ----------------------------------------------------------------------------------------------- stats
    @property
    def requests(self) -> list[RequestRecord]:
        with self._lock:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=2.0)
            return list(self._stats.requests)

    @property
    def bytes_served(self) -> dict[str, int]:
        with self._lock:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=2.0)
            return defaultdict(int, self._stats.bytes_served)

    def requests_for(self, path_glob: str, method: str | None = None) -> list[RequestRecord]:
        return [
            r
            for r in self.requests
            if fnmatch.fnmatchcase(r.path, path_glob) and (method is None or r.method == method.upper())
        ]

    def _begin(self) -> None:
        with self._lock:
            self._in_flight += 1

    def _record(self, record: RequestRecord, served_key: str | None, *, counted: bool) -> None:
        with self._lock:
            self._stats.requests.append(record)
            if served_key is not None and record.body_bytes:
                self._stats.bytes_served[served_key] += record.body_bytes
            if counted:
                self._in_flight -= 1
                self._idle.notify_all()


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls socket.getfqdn(), a reverse DNS lookup that can stall in sandboxes.
        import socketserver

        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]  # type: ignore[assignment]

    def handle_error(self, request: object, client_address: object) -> None:
        # Clients hanging up (timeouts, injected drops) are expected here, not errors worth printing.
        pass


_RANGE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$", re.IGNORECASE)


class _HubHandler(BaseHTTPRequestHandler):
    fakehub: FakeHub
    protocol_version = "HTTP/1.1"  # keep-alive and Range, like the real hub
    _repo_type = "model"  # of the request being answered: "model" or "dataset"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        pass

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    # ------------------------------------------------------------------------------------------------------
    def _handle(self, method: str) -> None:
        hub = self.fakehub
        split = urlsplit(self.path)
        raw_path, query = split.path, split.query
        path = unquote(raw_path)
        self._method, self._path, self._query = method, path, query
        self._served_key: str | None = None
        self._status = 0
        self._body_bytes = 0
        counted = False
        try:
            # A stalled request is not counted as in flight until it wakes up: readers must not wait for it.
            delay = hub._take("delay", method, path)
            if delay is not None and hub._stopping.wait(delay.seconds):
                self.close_connection = True
                return
            hub._begin()
            counted = True
            fault = hub._take("status", method, path)
            if fault is not None:
                headers = {}
                if fault.retry_after is not None:
                    headers["Retry-After"] = str(int(fault.retry_after))
                self._error(fault.status, f"injected {fault.status}", headers=headers)
                return
            self._route(method, raw_path, path, parse_qs(query))
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            hub._record(
                RequestRecord(
                    method=method,
                    path=path,
                    query=query,
                    headers={k.lower(): v for k, v in self.headers.items()},
                    status=self._status,
                    body_bytes=self._body_bytes,
                ),
                self._served_key,
                counted=counted,
            )

    def _route(self, method: str, raw_path: str, path: str, query: dict[str, list[str]]) -> None:
        hub = self.fakehub
        self._repo_type = "model"
        if path.startswith("/api/models/"):
            self._api(path[len("/api/models/") :], query)
        elif path.startswith("/api/datasets/"):
            self._repo_type = "dataset"
            self._api(path[len("/api/datasets/") :], query)
        elif path.startswith(CDN_PREFIX):
            self._cdn(method, path[len(CDN_PREFIX) :])
        elif "/resolve/" in raw_path:
            if raw_path.startswith("/datasets/"):
                self._repo_type = "dataset"
                raw_path = raw_path[len("/datasets") :]
            # Split the raw path: a revision like "refs/pr/1" arrives percent-encoded as one segment.
            repo_raw, rest = raw_path.lstrip("/").split("/resolve/", 1)
            rev_raw, _, file_raw = rest.partition("/")
            repo_id, rev, filename = unquote(repo_raw), unquote(rev_raw), unquote(file_raw)
            if self._refused(repo_id):
                return
            repo = hub._of_type(self._repo_type).get(repo_id)
            if repo is None:
                self._error(404, "Repository not found", code="RepoNotFound")
                return
            self._resolve(method, repo, rev, filename)
        else:
            self._error(404, "Not found")

    def _split_repo(self, rest: str) -> tuple[str, str]:
        """``org/name/tree/main`` -> (``org/name``, ``/tree/main``); matches known repos first."""
        for repo_id in sorted(self.fakehub._of_type(self._repo_type), key=len, reverse=True):
            if rest == repo_id or rest.startswith(repo_id + "/"):
                return repo_id, rest[len(repo_id) :]
        parts = rest.split("/")
        repo_id = "/".join(parts[:2]) if len(parts) >= 2 and parts[1] not in ("revision", "tree") else parts[0]
        return repo_id, rest[len(repo_id) :]

    def _refused(self, repo_id: str) -> bool:
        forced = self.fakehub._repo_status.get(repo_id)
        if forced is None:
            return False
        status, code = forced
        if code is None:
            code = {401: "RepoNotFound", 404: "RepoNotFound", 403: "GatedRepo"}.get(status)
        message = {
            401: "Invalid username or password.",
            403: "Access to model is restricted. You must have access to it and be authenticated to access it.",
            404: "Repository not found",
        }.get(status, "refused")
        self._error(status, message, code=code)
        return True

    def _api(self, rest: str, query: dict[str, list[str]]) -> None:
        repo_id, suffix = self._split_repo(rest)
        if self._refused(repo_id):
            return
        repo = self.fakehub._of_type(self._repo_type).get(repo_id)
        if repo is None:
            self._error(404, "Repository not found", code="RepoNotFound")
            return
        if suffix in ("", "/"):
            self._info(repo, "main", query)
        elif suffix.startswith("/revision/"):
            self._info(repo, suffix[len("/revision/") :], query)
        elif suffix.startswith("/tree/"):
            rev, _, sub = suffix[len("/tree/") :].partition("/")
            self._tree(repo, rev, sub, query)
        else:
            self._error(404, "Not found")

    def _commit(self, repo: FakeRepo, rev: str) -> str | None:
        if rev in repo.refs:
            return repo.refs[rev]
        return repo.commit if rev == repo.commit else None

    def _info(self, repo: FakeRepo, rev: str, query: dict[str, list[str]]) -> None:
        commit = self._commit(repo, rev)
        if commit is None:
            self._error(404, f"Invalid rev id: {rev}", code="RevisionNotFound")
            return
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for f in sorted(repo.files.values(), key=lambda f: f.path):
            sibling: dict[str, object] = {"rfilename": f.path}
            if blobs:
                sibling.update(blobId=f.blob_id, size=f.size)
                if f.lfs:
                    sibling["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
            siblings.append(sibling)
        org = repo.repo_id.split("/")[0] if "/" in repo.repo_id else None
        body = {
            "_id": hashlib.md5(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            **({"modelId": repo.repo_id} if repo.repo_type == "model" else {}),
            "author": org,
            "sha": commit,
            "lastModified": "2024-01-01T00:00:00.000Z",
            "createdAt": "2024-01-01T00:00:00.000Z",
            "private": False,
            "disabled": False,
            "gated": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            **({"library_name": "transformers"} if repo.repo_type == "model" else {}),
            "siblings": siblings,
            "usedStorage": sum(f.size for f in repo.files.values()),
        }
        self._json(200, body)

    def _tree(self, repo: FakeRepo, rev: str, sub: str, query: dict[str, list[str]]) -> None:
        commit = self._commit(repo, rev)
        if commit is None:
            self._error(404, f"Invalid rev id: {rev}", code="RevisionNotFound")
            return
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        prefix = sub.strip("/") + "/" if sub.strip("/") else ""
        entries: list[dict[str, object]] = []
        dirs: set[str] = set()
        for f in sorted(repo.files.values(), key=lambda f: f.path):
            if not f.path.startswith(prefix):
                continue
            rel = f.path[len(prefix) :]
            parts = rel.split("/")
            for depth in range(1, len(parts)):
                d = prefix + "/".join(parts[:depth])
                if (recursive or depth == 1) and d not in dirs:
                    dirs.add(d)
                    entries.append({"type": "directory", "oid": git_blob_sha1(d.encode()), "size": 0, "path": d})
            if not recursive and len(parts) > 1:
                continue
            entry: dict[str, object] = {"type": "file", "oid": f.blob_id, "size": f.size, "path": f.path}
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
            entries.append(entry)
        self._json(200, entries)

    def _resolve(self, method: str, repo: FakeRepo, rev: str, filename: str) -> None:
        hub = self.fakehub
        commit = self._commit(repo, rev)
        if commit is None:
            self._error(404, f"Invalid rev id: {rev}", code="RevisionNotFound")
            return
        f = repo.files.get(filename)
        if f is None:
            self._error(404, "Entry not found", code="EntryNotFound", headers={"X-Repo-Commit": commit})
            return
        if f.lfs and hub.cdn_host is not None:
            location = f"http://{hub.cdn_host}:{hub.port}{CDN_PREFIX}{quote(repo.repo_id)}/{f.sha256}/{quote(f.path)}"
            self._status = 302
            self.send_response(302)
            self.send_header("Location", location)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{f.blob_id}"')
            self.send_header("X-Linked-Etag", f'"{f.sha256}"')
            self.send_header("X-Linked-Size", str(f.size))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        etag = f.sha256 if f.lfs else f.blob_id
        extra = {"X-Repo-Commit": commit}
        if f.lfs:
            extra.update({"X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size)})
        self._serve_file(method, repo, f, etag, extra)

    def _cdn(self, method: str, rest: str) -> None:
        hub = self.fakehub
        for repo in (*hub.repos.values(), *hub.datasets.values()):
            prefix = repo.repo_id + "/"
            if not rest.startswith(prefix):
                continue
            sha256, _, filename = rest[len(prefix) :].partition("/")
            f = repo.files.get(filename)
            if f is not None and f.sha256 == sha256:
                self._serve_file(method, repo, f, f.sha256, {})
                return
        self._error(404, "NoSuchKey")

    def _serve_file(self, method: str, repo: FakeRepo, f: FakeFile, etag: str, extra: Mapping[str, str]) -> None:
        hub = self.fakehub
        key = f"{repo.repo_id}/{f.path}"
        content = f.content.translate(_FLIP) if key in hub._corrupt else f.content
        size = len(content)
        start, end, status = 0, size - 1, 200
        range_header = self.headers.get("Range")
        if_range = self.headers.get("If-Range")
        if hub.ranges and range_header and (if_range is None or if_range.strip() == f'"{etag}"'):
            m = _RANGE.match(range_header)
            if m is None:
                self._error(400, "bad range")
                return
            first, last = m.groups()
            if first:
                start = int(first)
                end = min(int(last), size - 1) if last else size - 1
            elif last:  # suffix range: the last n bytes
                start, end = max(size - int(last), 0), size - 1
            if start >= size or start > end:
                self._error(416, "Range Not Satisfiable", headers={"Content-Range": f"bytes */{size}"})
                return
            status = 206
        length = end - start + 1 if size else 0
        self._status = status
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        if hub.ranges:
            self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{etag}"')
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        for name, value in extra.items():
            self.send_header(name, value)
        self.end_headers()
        if method == "HEAD":
            return
        self._served_key = key
        drop = hub._take("drop", method, self._path)
        limit = length if drop is None else min(drop.nbytes, length)
        pos = start
        while pos < start + limit:
            n = min(hub.chunk_size, start + limit - pos)
            self.wfile.write(content[pos : pos + n])
            self._body_bytes += n
            pos += n
        self.wfile.flush()
        if drop is not None and limit < length:
            self._hang_up(reset=drop.reset)

    def _hang_up(self, *, reset: bool) -> None:
        self.close_connection = True
        if reset:
            # Give the client a moment to read what was sent, then RST instead of FIN (SO_LINGER with 0 timeout):
            # httpx reports that as ReadError, a clean early close as RemoteProtocolError.
            time.sleep(0.1)
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()

    def _json(self, status: int, body: object, headers: Mapping[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self._status = status
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self._method != "HEAD":
            self.wfile.write(data)

    def _error(
        self, status: int, message: str, *, code: str | None = None, headers: Mapping[str, str] | None = None
    ) -> None:
        all_headers = dict(headers or {})
        if code is not None:
            all_headers["X-Error-Code"] = code
        all_headers["X-Error-Message"] = message
        self._json(status, {"error": message}, all_headers)
