"""One try of a notification to one destination, bounded as a whole by a deadline; never raises.

urllib's and apprise's timeouts bound each socket operation, not the request: a destination that
answers one byte every few seconds held a delivery (and the detached notify child) forever. Here:

- ``post_json`` runs the POST in a daemon thread that the caller waits for until the deadline; then
  the request's connections are shut down (``_Conns``), which ends the thread's blocked read at once.
  A DNS lookup or TLS handshake that hangs past it is left behind in its thread (a detached notify
  child exits regardless; the supervisor's ends with the supervisor).
- ``apprise_send`` is bounded the same way (apprise's own ``cto``/``rto`` bound each step).
- ``run_command`` runs the command as ``/bin/sh FILE``, its text in a 0600 temp file (so argv, which
  every user may read in ``ps``, shows no command and no token; stdin stays the message), in a process
  group of its own: at the deadline the whole group gets SIGTERM, a grace, then SIGKILL; what the
  shell left behind in its group when it ended is ended too.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

HTTP = ("http://", "https://")
TIMEOUT_S = 5.0  # one socket operation (connect, send, one read) at most; the deadline bounds them all
GRACE_S = 1.0  # a command's group between SIGTERM and SIGKILL


def bounded(fn: Callable[[], str | None], limit: float, cut: Callable[[], None] | None = None) -> str | None:
    """``fn()`` (None, or why it failed) in a daemon thread, waited for at most ``limit`` seconds. Past
    it: ``cut()`` (to end what the thread waits on) and why; the thread is left behind."""
    out: list[str | None] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # whatever a delivery does, the run's result stands
            out.append(f"{type(exc).__name__}: {exc}")

    t = threading.Thread(target=run, name="ftlaunch-notify-try", daemon=True)
    t.start()
    t.join(max(0.0, limit))
    if out:
        return out[0]
    if cut is not None:
        cut()
    return f"no answer within the deadline ({limit:.1f} s)"


# ---------------------------------------------------------------- HTTP(S): a JSON POST


class _Conns:
    """The connections one request opened, shut down together when its deadline passes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made: list[http.client.HTTPConnection] = []
        self._cut = False

    def maker(self, cls: type[http.client.HTTPConnection]) -> Callable[..., http.client.HTTPConnection]:
        def make(*args: Any, **kw: Any) -> http.client.HTTPConnection:
            with self._lock:
                if self._cut:  # a redirect after the deadline: no new connection
                    raise TimeoutError("the deadline passed")
                conn = cls(*args, **kw)
                self._made.append(conn)
            return conn

        return make

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            made = list(self._made)
        for conn in made:
            sock = conn.sock
            if sock is not None:
                try:  # the plain socket's shutdown, under an SSL socket too: the blocked read returns
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except (OSError, TypeError):
                    pass  # closed already (a closed socket has no fd: nothing else is shut)


def _handlers(conns: _Conns) -> list[urllib.request.BaseHandler]:
    class Http(urllib.request.HTTPHandler):
        def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
            return self.do_open(conns.maker(http.client.HTTPConnection), req)

    class Https(urllib.request.HTTPSHandler):
        def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
            return self.do_open(conns.maker(http.client.HTTPSConnection), req, context=self._context)

    return [Http(), Https()]


def opener(url: str, env: Mapping[str, str], *handlers: urllib.request.BaseHandler) -> urllib.request.OpenerDirector:
    """Proxies from ``env`` (not os.environ), never for loopback or no_proxy hosts."""
    host = urllib.parse.urlsplit(url).hostname or ""
    no_proxy = env.get("no_proxy") or env.get("NO_PROXY") or ""
    proxies: dict[str, str] = {}
    if host not in ("localhost", "127.0.0.1", "::1") and not urllib.request.proxy_bypass_environment(
        host, {"no": no_proxy}
    ):
        for scheme in ("http", "https"):
            value = env.get(f"{scheme}_proxy") or env.get(f"{scheme.upper()}_PROXY")
            if value:
                proxies[scheme] = value
    return urllib.request.build_opener(urllib.request.ProxyHandler(proxies), *handlers)


def post_json(url: str, body: bytes, env: Mapping[str, str], limit: float) -> str | None:
    """POST ``body`` (JSON) to ``url``: None when it went (a 2xx/3xx answer), else why not, within
    ``limit`` seconds in all (connect, send, every read)."""
    conns = _Conns()

    def post() -> str | None:
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
        with opener(url, env, *_handlers(conns)).open(req, timeout=max(0.05, min(TIMEOUT_S, limit))) as resp:
            resp.read(1 << 16)
        return None

    return bounded(post, limit, conns.cut)


# ---------------------------------------------------------------- apprise (the notify extra)


def apprise_send(url: str, title: str, text: str, limit: float) -> str | None:
    """Send through apprise, within ``limit`` seconds in all. None when it went, else apprise's reason
    with every part of the URL masked."""
    return bounded(lambda: _apprise(url, title, text, max(0.05, min(TIMEOUT_S, limit))), limit)


def _apprise(url: str, title: str, text: str, timeout: float) -> str | None:
    try:
        import apprise
    except ImportError:
        return "apprise is not installed: pip install 'ftlaunch[notify]'"
    shown = f"{url.split('://', 1)[0]}://***"
    a = apprise.Apprise()
    sep = "&" if "?" in url else "?"
    if not a.add(f"{url}{sep}cto={timeout:g}&rto={timeout:g}" if "cto=" not in url else url):
        return f"apprise does not understand {shown}"
    import logging

    with apprise.LogCapture(level=logging.WARNING) as log:  # apprise's reason, said in the event
        ok = a.notify(body=text, title=title)
    if ok:
        return None
    said = [ln.split(" - ", 2)[-1].strip() for ln in log.getvalue().splitlines() if ln.strip()]
    why = f": {hidden(said[-1][:300], url)}" if said else ""
    return f"apprise could not deliver to {shown}{why}"


def hidden(text: str, url: str) -> str:
    """``text`` without ``url`` or any part of it: an apprise URL's host, user, password, path and
    query values may each be a token (tgram://BOTTOKEN/..., slack://TA/TB/TC, mailto://u:PASSWORD@...)."""
    u = urllib.parse.urlsplit(url)
    parts = [url, u.netloc, u.hostname, u.username, u.password, *u.path.split("/")]
    parts += [v for _, v in urllib.parse.parse_qsl(u.query)]
    values = {x for part in parts if part for x in (part, urllib.parse.unquote(part)) if len(x) >= 4}
    for value in sorted(values, key=len, reverse=True):
        text = text.replace(value, "***")
    return text


# ---------------------------------------------------------------- a command


def run_command(cmd: str, stdin: str, env: Mapping[str, str], limit: float, grace: float = GRACE_S) -> str | None:
    """Run ``cmd`` (shell text) with ``stdin`` and ``env``: None when it exited 0, else why not. The
    text goes through a 0600 temp file, never argv; the command's process group is killed whole when
    it runs past ``limit`` seconds, and what it left behind is ended when its shell exits."""
    fd, script = tempfile.mkstemp(prefix="ftlaunch-notify-", suffix=".sh")  # 0600, by mkstemp
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(cmd)
        proc = subprocess.Popen(
            ["/bin/sh", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env),
            text=True,
            start_new_session=True,  # its own group: ended whole, children and all
        )
        try:
            _, err = proc.communicate(stdin, timeout=max(0.05, limit))
        except subprocess.TimeoutExpired:
            end_group(proc, grace)
            return f"notify command ran past the deadline ({limit:.1f} s): its process group was killed"
        end_group(proc, grace)  # the shell is gone: whatever it left running in its group goes too
        if proc.returncode != 0:
            return f"notify command exited {proc.returncode}: {err.strip()[-300:]}"
        return None
    finally:
        try:
            os.unlink(script)
        except OSError:
            pass


def end_group(proc: subprocess.Popen[Any], grace: float) -> None:
    """SIGTERM to ``proc``'s process group (it leads one), up to ``grace`` seconds for the group to
    empty, then SIGKILL; the shell reaped, its pipes closed."""
    if _signal_group(proc.pid, signal.SIGTERM):
        end = time.monotonic() + grace
        while _group_alive(proc.pid):
            proc.poll()  # reap the shell
            if time.monotonic() >= end:
                _signal_group(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.02)
    try:
        proc.communicate(timeout=1)  # reap the shell; the pipes' last bytes
    except (subprocess.TimeoutExpired, ValueError, OSError):  # a pipe held outside the group
        proc.kill()
        proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs. Zombies do not count: orphans are reparented to
    init, which may reap them a second later (measured here: 1 s), and they hold nothing."""
    if not _signal_group(pgid, 0):
        return False
    try:
        names = os.listdir("/proc")
    except OSError:  # no /proc: the signal's answer
        return True
    for name in names:
        try:
            if name.isdigit():
                fields = Path("/proc", name, "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                    return True
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return False


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the group; False when no process of it is left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def command_env(env: Mapping[str, str], data: Mapping[str, Any], body: str, extra: Mapping[str, str]) -> dict[str, str]:
    """A command's environment: ``env`` plus the message in FTLAUNCH_* variables."""
    child = dict(env)
    child.update(
        FTLAUNCH_SUMMARY=body,
        FTLAUNCH_STATUS=str(data.get("status")),
        FTLAUNCH_RUN_ID=str(data.get("run_id") or ""),
        FTLAUNCH_SCHEDULE=str(data.get("schedule")),
        FTLAUNCH_OUTPUT_DIR=str(data.get("output_dir") or ""),
        **extra,
    )
    return child


def post_or_run(
    target: str,
    data: Mapping[str, Any],
    env: Mapping[str, str],
    timeout: float = 10.0,
    extra_env: Mapping[str, str] | None = None,
) -> str | None:
    """POST ``data`` as JSON to an http(s) URL, or run a command with it on stdin and in FTLAUNCH_*
    variables, all within ``timeout`` seconds. None on success, else why it failed. Never raises."""
    try:
        body = json.dumps(data, default=str)
        if target.startswith(HTTP):
            return post_json(target, body.encode(), env, timeout)
        return run_command(target, body, command_env(env, data, body, extra_env or {}), timeout)
    except Exception as exc:  # whatever the notifier does, the run's result stands
        return f"{type(exc).__name__}: {exc}"
