"""Notifications from the supervisor, for every run: what is sent, where, and how it never gets in the way.

Destinations (``NotifySpec``): ``--notify URL`` (repeatable), ``FTLAUNCH_NOTIFY`` (URLs separated
by spaces or commas): a plain http(s) URL gets the message as a JSON POST; any other scheme
(``json://``, ``slack://``, ``mailto://``, ``dingtalk://``, ``ntfy://`` ...) goes through apprise, the
optional ``notify`` extra (``pip install 'ftlaunch[notify]'``). ``--notify-cmd CMD`` runs a command
with the message as JSON on stdin and in FTLAUNCH_* variables. ``--notify-on`` picks the events
(``EVENTS``; default all). The spec is kept in the run's secrets.json (0600) under ``NOTIFY_KEY``,
never handed to the trainer; a destination is shown only as ``redact_target`` makes it. A run given
no destination of its own uses ``$FTLAUNCH_HOME/notify.yaml``'s (``load_file``: URLs and commands,
each with its events), read at each start, so cron'd and resumed runs notify without flags; a wrong
file is a ``NotifyConfigError`` (exit 19) before a run is created.

``Notifier`` is what the supervisor holds: ``event(name, **details)`` only queues. One daemon thread
builds the message from the run folder (run id and name, config, machine, status, steps, elapsed,
last loss and a trend, output_dir, last checkpoint; on a failure the cause and the log's last lines;
secrets redacted), delivers it to each destination with a few retries with backoff, all within one
deadline per destination (``DEADLINE_S``; ftlaunch.run.notify_delivery bounds each try as a whole,
and kills a command's whole process group), and records each outcome as a ``notified`` event.
Nothing here raises into the supervisor; ``close`` waits a moment for the queue, then hands what is
left to a detached child (``python -m ftlaunch.run.notify RUN_DIR``, the jobs on stdin, each with its
deadline) so a dead destination never delays the run's end, and the child ends by the last deadline.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import queue
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ftlaunch.errors import ConfigError, NotifyConfigError, StateError
from ftlaunch.files import NOTIFY_LIMIT, home, now_iso, read_user_text
from ftlaunch.run.events import Event
from ftlaunch.run.notify_delivery import HTTP, TIMEOUT_S, apprise_send, post_or_run
from ftlaunch.run.secrecy import (
    LIST_SPLIT,
    NOTIFY_KEY,
    keep_notify_env,
    kept_notify_env,
    scrub,
    secret_values,
    with_kept_notify_env,
)

EVENTS = (
    "started",
    "succeeded",
    "failed",
    "stalled",
    "oom_recovered",
    "no_progress",
    "diverged",
    "disk_full",
    "disk_forecast",
    "env_changed",
    "stopped",
    "lost",
)
FAILURE_EVENTS = frozenset({"failed", "stalled", "no_progress", "diverged", "disk_full", "env_changed", "lost"})
DEADLINE_S = 30.0  # one notification to one destination, all its tries: after it, given up
RETRIES = 3
BACKOFF_S = 0.5
CLOSE_WAIT_S = 0.5
LATE_S = 3.0  # the detached child waits this past the last deadline for its tries to end (a command's grace)
LOG_LINES = 20
NOTIFY_FILE = "notify.yaml"  # in FTLAUNCH_HOME: the destinations of every run given none of its own
FILE_HINT = (
    "notify.yaml holds `destinations:`, a list of entries with `url:` or `cmd:` and optionally `on:` "
    "(events; a top-level `on:` is every entry's default); fix or remove it"
)


# ---------------------------------------------------------------- what to send where (pure)


@dataclass(frozen=True)
class Route:
    """A destination of notify.yaml with the events chosen for it."""

    target: str  # a URL, or "cmd:" + a command
    on: frozenset[str] = field(default_factory=lambda: frozenset(EVENTS))


@dataclass(frozen=True)
class NotifySpec:
    urls: tuple[str, ...] = ()
    cmd: str | None = None
    on: frozenset[str] = field(default_factory=lambda: frozenset(EVENTS))
    routes: tuple[Route, ...] = ()  # notify.yaml's destinations, each with its own events

    def __bool__(self) -> bool:
        return bool(self.urls or self.cmd or self.routes)

    def destinations(self) -> list[str]:
        """Each place a message goes: the URLs, then ``cmd:`` + the command, then notify.yaml's."""
        return [*self.urls, *([f"cmd:{self.cmd}"] if self.cmd else []), *(r.target for r in self.routes)]

    def wants(self, i: int, event: str) -> bool:
        """Whether destination ``i`` (of ``destinations()``) chose ``event``."""
        own = len(self.urls) + (1 if self.cmd else 0)
        return event in (self.on if i < own else self.routes[i - own].on)

    def events(self) -> frozenset[str]:
        """The events some destination chose."""
        own = self.on if self.urls or self.cmd else frozenset()
        return own.union(*(r.on for r in self.routes))

    def secret_values(self) -> list[str]:
        """The destinations as text no file, log or message may hold."""
        return [t.removeprefix("cmd:") for t in self.destinations()]

    def to_json(self) -> dict[str, Any]:
        routes = [{"target": r.target, "on": sorted(r.on)} for r in self.routes]
        return {
            "urls": list(self.urls),
            "cmd": self.cmd,
            "on": sorted(self.on),
            **({"routes": routes} if routes else {}),
        }

    @classmethod
    def from_json(cls, d: Any) -> NotifySpec:
        if not isinstance(d, Mapping):
            return cls()
        on = d.get("on")
        routes = [r for r in d.get("routes") or () if isinstance(r, Mapping) and r.get("target")]
        return cls(
            urls=tuple(str(u) for u in d.get("urls") or () if u),
            cmd=str(d["cmd"]) if d.get("cmd") else None,
            on=frozenset(on) if isinstance(on, list) and on else frozenset(EVENTS),
            routes=tuple(Route(str(r["target"]), frozenset(r.get("on") or EVENTS)) for r in routes),
        )

    def with_env(self, env: Mapping[str, str]) -> NotifySpec:
        """Plus FTLAUNCH_NOTIFY's URLs (read when the supervisor starts: schedules and resumes too)."""
        extra = tuple(u for u in LIST_SPLIT.split(env.get("FTLAUNCH_NOTIFY", "")) if u and u not in self.urls)
        return replace(self, urls=self.urls + extra) if extra else self


def _chosen(words: Iterable[str]) -> tuple[frozenset[str], list[str]]:
    """Event names as given (``all`` or none: every one), and the unknown ones among them."""
    words = [w for w in words if w]
    if not words or words == ["all"]:
        return frozenset(EVENTS), []
    return frozenset(words), sorted(set(words) - set(EVENTS))


def parse_on(text: str | None) -> frozenset[str]:
    """``--notify-on started,failed``: the events chosen ("all" or nothing: every one)."""
    on, unknown = _chosen(LIST_SPLIT.split(text or ""))
    if unknown:
        raise ConfigError(
            f"--notify-on: unknown event(s) {', '.join(unknown)}", hint=f"choose among: {', '.join(EVENTS)}"
        )
    return on


# ---------------------------------------------------------------- notify.yaml in FTLAUNCH_HOME


def notify_file(env: Mapping[str, str]) -> Path:
    return home(env) / NOTIFY_FILE


def load_file(env: Mapping[str, str], apprise_ok: bool | None = None) -> NotifySpec:
    """notify.yaml's destinations (``routes``); none when there is no file. NotifyConfigError (exit 19)
    naming the file and each wrong key when it cannot be read or is wrong."""
    path = notify_file(env)
    try:  # a regular file of at most NOTIFY_LIMIT: /dev/zero, a FIFO or a huge file is refused at once
        text = read_user_text(path, limit=NOTIFY_LIMIT, what="the file", error=_file_error(path))
    except (FileNotFoundError, NotADirectoryError):  # FTLAUNCH_HOME a file: that is said elsewhere (exit 12)
        return NotifySpec()
    if apprise_ok is None:
        apprise_ok = importlib.util.find_spec("apprise") is not None
    return parse_file(text, str(path), apprise_ok)


def _file_error(path: Path) -> Callable[[str, str], NotifyConfigError]:
    return lambda problem, hint: NotifyConfigError(str(path), [problem], hint=f"{hint}; {FILE_HINT}")


def parse_file(text: str, where: str, apprise_ok: bool) -> NotifySpec:
    """notify.yaml's text as destinations, every problem listed at once. A message never quotes a
    value (a URL holds its token): it names the key, and a URL only as ``redact_target`` shows it."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise NotifyConfigError(where, [f"not YAML{at}: {getattr(exc, 'problem', None) or 'unreadable'}"]) from None
    if data is None:
        return NotifySpec()  # an empty file: no destinations
    if not isinstance(data, Mapping):
        raise NotifyConfigError(where, ["expected a mapping with `destinations:`"], hint=FILE_HINT)
    data = _on_key(data)
    problems: list[str] = []
    unknown = sorted(str(k) for k in data if k not in ("destinations", "on"))
    if unknown:
        problems.append(f"unknown key(s) {', '.join(unknown)} (known: destinations, on)")
    default_on = _file_events(data["on"], "on", problems) if "on" in data else frozenset(EVENTS)
    dests = data.get("destinations")
    if not isinstance(dests, list):
        what = "missing" if "destinations" not in data else "expected a list"
        problems.append(f"destinations: {what} (entries with `url:` or `cmd:`)")
        dests = []
    routes = []
    for n, d in enumerate(dests, 1):
        key = f"destinations (entry {n})"
        if not isinstance(d, Mapping):
            problems.append(f"{key}: expected a mapping with `url:` or `cmd:`")
            continue
        d = _on_key(d)
        unknown = sorted(str(k) for k in d if k not in ("url", "cmd", "on"))
        if unknown:
            problems.append(f"{key}: unknown key(s) {', '.join(unknown)} (known: url, cmd, on)")
        given = [k for k in ("url", "cmd") if k in d]
        if len(given) != 1:
            problems.append(f"{key}: give one of url, cmd" + (" (not both)" if given else ""))
            continue
        kind, value = given[0], d[given[0]]
        if not isinstance(value, str) or not value.strip():
            problems.append(f"{key}: {kind}: expected a non-empty string")
            continue
        on = _file_events(d["on"], f"{key}: on", problems) if "on" in d else default_on
        if kind == "url":
            problems += [f"{key}: url: {p}" for p in url_problems([value.strip()], apprise_ok)]
        routes.append(Route(value.strip() if kind == "url" else f"cmd:{value}", on))
    if problems:
        raise NotifyConfigError(where, problems, hint=FILE_HINT)
    return NotifySpec(routes=tuple(routes))


def _on_key(m: Mapping[Any, Any]) -> dict[Any, Any]:
    """YAML 1.1 (PyYAML) reads a bare ``on:`` key as the boolean True: it is the ``on`` key here."""
    return {("on" if k is True else k): v for k, v in m.items()}


def _file_events(value: Any, key: str, problems: list[str]) -> frozenset[str]:
    """An ``on:`` of notify.yaml: a list of event names or one comma-separated string."""
    if isinstance(value, str):
        words = LIST_SPLIT.split(value)
    elif isinstance(value, list) and all(isinstance(w, str) for w in value):
        words = list(value)
    else:
        problems.append(f"{key}: expected a list of event names")
        return frozenset(EVENTS)
    on, unknown = _chosen(words)
    if unknown:
        problems.append(f"{key}: unknown event(s) {', '.join(unknown)} (choose among: {', '.join(EVENTS)})")
    return on


def shared_secret_values(env: Mapping[str, str]) -> list[str]:
    """The destinations a run uses without keeping them (notify.yaml's, read leniently: a wrong file's
    too; FTLAUNCH_NOTIFY's URLs), as text a bundle must not hold."""
    found = [u for u in LIST_SPLIT.split(env.get("FTLAUNCH_NOTIFY", "")) if u]
    try:
        import yaml

        path = notify_file(env)
        data = yaml.safe_load(read_user_text(path, limit=NOTIFY_LIMIT, what="the file", error=_file_error(path)))
    except Exception:
        return found
    dests = data.get("destinations") if isinstance(data, Mapping) else None
    return found + [str(d[k]) for d in dests or () if isinstance(d, Mapping) for k in ("url", "cmd") if d.get(k)]


def url_problems(urls: Iterable[str], apprise_ok: bool) -> list[str]:
    """Every URL that cannot be sent to, each with why (all listed at once)."""
    out = []
    for u in urls:
        scheme = urllib.parse.urlsplit(u).scheme
        if not scheme or "://" not in u:
            out.append(f"{redact_target(u)}: not a URL (scheme://...)")
        elif not u.startswith(HTTP) and not apprise_ok:
            out.append(f"{scheme}://***: needs apprise: pip install 'ftlaunch[notify]' (or use an http(s) URL)")
    return out


def redact_target(target: str | None) -> str | None:
    """A destination as it may be shown: URLs hold tokens (in the path, the query, the user part)."""
    if not target:
        return target
    if target.startswith("cmd:"):
        words = target[4:].split()
        return f"command {words[0]} ***" if words else "command ***"
    if target.startswith(HTTP):
        u = urllib.parse.urlsplit(target)
        return f"{u.scheme}://{u.hostname}{f':{u.port}' if u.port else ''}/***"
    if "://" in target:
        return f"{target.split('://', 1)[0]}://***"
    return "***"


def title_of(msg: Mapping[str, Any]) -> str:
    kind = f" ({msg['failure_kind']})" if msg.get("failure_kind") else ""
    return f"ftlaunch: run {msg.get('name') or msg.get('run_id')} {msg.get('event')}{kind}"


def text_of(msg: Mapping[str, Any]) -> str:
    """The message as plain text (apprise bodies, e-mail)."""
    lines = [
        title_of(msg),
        f"run {msg.get('run_id')} on {msg.get('machine')}; config {msg.get('config')}",
        f"status {msg.get('status')}, step {msg.get('step')}/{msg.get('total_steps')}, "
        f"elapsed {msg.get('elapsed_s')} s, loss {msg.get('loss')} {msg.get('loss_trend') or ''}".rstrip(),
        f"output_dir {msg.get('output_dir')}; last checkpoint {msg.get('last_checkpoint')}",
    ]
    if msg.get("message"):
        lines.append(f"why: {msg['message']}")
    if msg.get("details"):
        lines.append("details: " + json.dumps(msg["details"], default=str, ensure_ascii=False))
    if msg.get("log_tail"):
        lines += ["last lines of the log:", *msg["log_tail"]]
    return "\n".join(lines)


# ---------------------------------------------------------------- the message (reads the run folder)


def message(
    run_dir: Path, event: str, details: Mapping[str, Any], env: Mapping[str, str], hidden: Iterable[str] = ()
) -> dict[str, Any]:
    """What every destination gets: the run as `status` sees it now, and why; secrets redacted (and
    ``hidden``: the destinations, notify.yaml's too)."""
    from ftlaunch.run.live import losses_of, sparkline, tail_lines
    from ftlaunch.run.store import RunFolder, read_secrets
    from ftlaunch.run.view import run_view

    folder = RunFolder(run_dir)
    try:
        v = run_view(run_dir, env=env)
    except StateError as exc:
        v = None
        why = exc.message
    records = tail_lines(folder.records, 16 * 1024)
    losses = losses_of(records)
    step, total, loss = latest_step(records, v.step if v else None, v.total_steps if v else None, v.loss if v else None)
    msg: dict[str, Any] = {
        "event": event,
        "t": now_iso(),
        "run_id": run_dir.name,
        "name": v.name if v else None,
        "config": None,
        "machine": platform.node(),
        "status": v.status.value if v else "unreadable",
        "failure_kind": v.failure_kind.value if v and v.failure_kind else None,
        "step": step,
        "total_steps": total,
        "elapsed_s": v.cost.wall_seconds if v else None,
        "loss": loss,
        "loss_trend": sparkline(losses, 10) or None,
        "recent_losses": [round(x, 4) for x in losses[-10:]],
        "output_dir": v.output_dir if v else None,
        "last_checkpoint": v.last_checkpoint if v else None,
        "message": (v.message if v else why),
        "details": dict(details),
    }
    try:
        from ftlaunch.run.store import read_state

        msg["config"] = read_state(run_dir).source_config
    except StateError:
        pass
    if event in FAILURE_EVENTS:
        lines = tail_lines(folder.train_log, 8 * 1024).decode("utf-8", errors="replace").replace("\r", "\n")
        msg["log_tail"] = [ln for ln in lines.splitlines() if ln.strip()][-LOG_LINES:]
    secrets = sorted({*secret_values(read_secrets(run_dir), env), *(h for h in hidden if len(h) >= 4)}, key=len)[::-1]
    clean = json.loads(scrub(json.dumps(msg, default=str, ensure_ascii=False).encode(), secrets))
    # Slack, Mattermost and Rocket.Chat incoming webhooks read "text": a plain https URL of theirs works too.
    clean["title"], clean["text"] = title_of(clean), text_of(clean)
    return clean


def latest_step(
    records: bytes, step: int | None, total: int | None, loss: float | None
) -> tuple[int | None, int | None, float | None]:
    """(step, total steps, loss): the state's, unless the last line of trainer_records.jsonl is a step
    record past it (the supervisor throttles its state updates: a stall's message said step 7 while
    the watchdog's cause said 'after step 8'). An attempt marker last: the state's. Pure."""
    from ftlaunch.run.records import MARK
    from ftlaunch.run.store import json_lines

    recs, _ = json_lines(records, lambda r: True)
    last = recs[-1] if recs else {}
    now = last.get("current_steps")
    if MARK in last or not isinstance(now, int) or (step is not None and now <= step):
        return step, total, loss
    got = last.get("loss")
    return now, last.get("total_steps") or total, float(got) if isinstance(got, (int, float)) else loss


# ---------------------------------------------------------------- delivery (one try; never raises)


def deliver(target: str, msg: Mapping[str, Any], env: Mapping[str, str], limit: float = DEADLINE_S) -> str | None:
    """Send ``msg`` to one destination once, within ``limit`` seconds in all: None when it went, else
    why not (ftlaunch.run.notify_delivery bounds each kind)."""
    try:
        if target.startswith("cmd:"):
            return post_or_run(target[4:], msg, env, limit, extra_env={"FTLAUNCH_EVENT": str(msg.get("event"))})
        if target.startswith(HTTP):
            return post_or_run(target, msg, env, limit)
        return apprise_send(target, title_of(msg), text_of(msg), limit)
    except Exception as exc:  # a notification never fails the run
        return f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------- the supervisor's notifier


# (destination, message, environment, seconds left): None when it went, else why not
Deliver = Callable[[str, Mapping[str, Any], Mapping[str, str], float], str | None]


@dataclass(eq=False)
class _Job:
    target: int  # index into the spec's destinations
    msg: dict[str, Any]
    tries: int = 0
    sending: bool = False  # a try under way (set under the notifier's lock): what close() hands on as in flight
    until: float | None = None  # its deadline (time.time(): it crosses to the child), set at its first try


@dataclass(eq=False)
class _Event:
    """An event the supervisor saw, its message not built yet (the delivery thread builds it)."""

    name: str
    details: dict[str, Any]
    seen_at: float


def _own_spec(run_dir: Path) -> NotifySpec:
    from ftlaunch.run.store import read_secrets

    return NotifySpec.from_json(read_secrets(run_dir).get(NOTIFY_KEY))


def read_spec(run_dir: Path, env: Mapping[str, str]) -> NotifySpec:
    """The run's own destinations (secrets.json); for a run given none, notify.yaml's, read now (each
    start reads the file as it is then); plus FTLAUNCH_NOTIFY's URLs. NotifyConfigError when the file
    is read and wrong."""
    spec = _own_spec(run_dir)
    if not spec:
        spec = replace(spec, routes=load_file(env).routes)
    return spec.with_env(_env_kept(run_dir, env))


def _env_kept(run_dir: Path, env: Mapping[str, str]) -> dict[str, str]:
    """``env``, with the FTLAUNCH_NOTIFY a Ray or Slurm submission kept in secrets.json when it has none
    (the job's environment never carries it: secrecy.keep_notify_env)."""
    from ftlaunch.run.store import read_secrets

    return with_kept_notify_env(read_secrets(run_dir), env)


def keep_spec(run_dir: Path, spec: NotifySpec) -> None:
    """Store a run's destinations in its secrets.json (0600), beside its secret config keys."""
    from ftlaunch.run.store import read_secrets, write_secrets

    secrets = read_secrets(run_dir)
    kept = kept_notify_env(secrets)  # a Ray or Slurm submission's FTLAUNCH_NOTIFY stays
    if spec or spec.on != frozenset(EVENTS):  # events chosen for FTLAUNCH_NOTIFY's destinations count too
        secrets[NOTIFY_KEY] = spec.to_json()
    else:
        secrets.pop(NOTIFY_KEY, None)
    write_secrets(run_dir, keep_notify_env(secrets, kept))


class Notifier:
    """Queued, threaded delivery for one supervisor. With no destination it does nothing (no thread)."""

    def __init__(
        self,
        run_dir: Path,
        spec: NotifySpec,
        env: Mapping[str, str],
        *,
        send: Deliver = deliver,
        retries: int = RETRIES,
        backoff: float = BACKOFF_S,
        close_wait: float = CLOSE_WAIT_S,
        spawn: Callable[..., Any] = subprocess.Popen,
        deadline: float = DEADLINE_S,
    ) -> None:
        self.run_dir = run_dir
        self.deadline = deadline
        self.spec = spec
        self.env = dict(env)
        self.send = send
        self.retries = retries
        self.backoff = backoff
        self.close_wait = close_wait
        self.spawn = spawn
        self.targets = spec.destinations()
        self._queue: queue.Queue[_Event | None] = queue.Queue()
        self._pending: list[_Job | _Event] = []  # not delivered yet: what close() hands on
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_run(cls, run_dir: Path, env: Mapping[str, str], **kw: Any) -> Notifier:
        try:
            spec = read_spec(run_dir, env)
        except NotifyConfigError as exc:  # notify.yaml went wrong since it was checked: said; the run goes on
            spec = _own_spec(run_dir).with_env(_env_kept(run_dir, env))
            _note(run_dir, Event.NOTIFY_CONFIG_ERROR, message=exc.message)
        except Exception:  # an unreadable secrets.json never stops a run
            spec = NotifySpec()
        return cls(run_dir, spec, env, **kw)

    def secret_values(self) -> list[str]:
        """The destinations, as text a log must not hold (train.log is redacted of them too)."""
        return self.spec.secret_values()

    def event(self, name: str, **details: Any) -> None:
        """Queue ``name`` for every destination when the user chose it. Never raises, never blocks: the
        message is built (run folder reads) by the delivery thread."""
        if not self.targets or name not in self.spec.events():
            return
        ev = _Event(name, dict(details), time.time())
        with self._lock:
            self._pending.append(ev)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="ftlaunch-notify", daemon=True)
            self._thread.start()
        self._queue.put(ev)

    def build(self, ev: _Event) -> dict[str, Any]:
        try:
            msg = message(self.run_dir, ev.name, ev.details, self.env, hidden=self.spec.secret_values())
        except Exception as exc:  # the message is best effort too: a bare one rather than none
            msg = {"event": ev.name, "run_id": self.run_dir.name, "t": now_iso(), "error": f"{type(exc).__name__}"}
        msg["seen_at"] = ev.seen_at
        return msg

    def _work(self) -> None:
        while True:
            ev = self._queue.get()
            if ev is None:
                return
            msg = self.build(ev)
            jobs = [_Job(i, msg) for i in range(len(self.targets)) if self.spec.wants(i, ev.name)]
            with self._lock:
                if ev not in self._pending:
                    continue  # handed on while it was built: the child builds and sends it
                self._pending.remove(ev)
                self._pending.extend(jobs)
            for job in jobs:
                self.attempt(job, queued=True)

    def attempt(self, job: _Job, queued: bool = False) -> bool:
        """Try one job, retrying with backoff, every try within the job's one deadline (``until``: set at
        its first try, ``deadline`` seconds on; kept when the job is handed on); record the outcome as a
        `notified` event. A ``queued`` job that ``close`` handed on meanwhile is left to the child (no
        second try, no second record); handed on while a try was under way, a delivered one is recorded
        here (the child, which waits for that record, then sends nothing: no message twice), a failed
        one left to the child."""
        err: str | None = "not tried"
        handed_on = False
        if job.until is None:
            job.until = time.time() + self.deadline
        while job.tries < self.retries:
            if job.tries:
                time.sleep(max(0.0, min(self.backoff * 2 ** (job.tries - 1), job.until - time.time())))
            left = job.until - time.time()
            if left <= 0:
                err = f"{'' if err == 'not tried' else f'{err}; '}given up: its deadline passed"
                break
            with self._lock:
                if queued and job not in self._pending:
                    return False
                job.sending = True
            job.tries += 1
            err = "not sent"
            try:
                err = self.send(self.targets[job.target], job.msg, self.env, left)
            finally:
                with self._lock:  # one step with the try's end: close() sees it under way, or done
                    job.sending = False
                    handed_on = queued and job not in self._pending
                    if queued and not handed_on and (err is None or job.tries >= self.retries):
                        self._pending.remove(job)  # done: nothing left for close() to hand on
            if err is None or handed_on:
                break
        if handed_on and err is not None:
            return False  # the child tries it again and records it
        self._record(job, err)
        return err is None

    def jobs_of(self, j: Mapping[str, Any]) -> list[tuple[_Job, bool]]:
        """A job as ``close`` handed it on: (job, whether a try of it was under way then); an event
        not built yet is built now, a job for each destination that chose it."""
        until = float(j.get("until") or time.time() + self.deadline)
        if "event" in j:
            seen = float(j.get("seen_at") or time.time())
            msg = self.build(_Event(str(j["event"]), dict(j.get("details") or {}), seen))
            wanted = [i for i in range(len(self.targets)) if self.spec.wants(i, msg["event"])]
            return [(_Job(i, msg, until=until), False) for i in wanted]
        if not 0 <= int(j["target"]) < len(self.targets):
            return []
        tries = max(0, min(int(j.get("tries", 0)), self.retries - 1))
        return [(_Job(int(j["target"]), dict(j["msg"]), tries=tries, until=until), bool(j.get("in_flight")))]

    def finish(self, job: _Job, in_flight: bool) -> None:
        """A handed-on job: one whose try was under way at the handover waits for the supervisor's record
        of it (delivered: nothing more), at most until its deadline; then tried to the end of it."""
        if in_flight and self.told(job, min(TIMEOUT_S + 1, (job.until or 0.0) - time.time())):
            return
        self.attempt(job)

    def told(self, job: _Job, wait: float) -> bool:
        """Whether ``job`` was recorded delivered (by the supervisor's thread, whose try was under way
        when it was handed on), waiting up to ``wait`` seconds for that record."""
        from ftlaunch.run.store import read_events

        target, deadline = redact_target(self.targets[job.target]), time.monotonic() + wait
        while True:
            for e in read_events(self.run_dir):
                if e.get("event") == "notified" and e.get("ok") and e.get("target") == target:
                    if e.get("notice") == job.msg.get("event") and e.get("seen_at") == job.msg.get("seen_at"):
                        return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def _record(self, job: _Job, err: str | None) -> None:
        from ftlaunch.run.transitions import note

        target = self.targets[job.target]
        latency = round(time.time() - float(job.msg.get("seen_at") or time.time()), 3)
        try:
            note(
                self.run_dir,
                Event.NOTIFIED,
                notice=job.msg.get("event"),
                target=redact_target(target),
                ok=err is None,
                tries=job.tries,
                seen_at=job.msg.get("seen_at"),
                latency_s=latency,
                **({"error": _scrubbed(err, self.targets)} if err else {}),
            )
        except OSError:
            pass  # a full run folder: the delivery still happened (or not); nothing to add

    def close(self) -> None:
        """Wait up to ``close_wait`` for the queue; hand what is left to a detached child."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(self.close_wait)
        with self._lock:  # "in flight" read with the pending jobs: a try starts and ends under this lock
            until = time.time() + self.deadline  # a job not tried yet: it ends by the run's end + the deadline
            jobs = [
                {"target": j.target, "tries": j.tries, "msg": j.msg, "in_flight": j.sending, "until": j.until or until}
                if isinstance(j, _Job)
                else {"event": j.name, "details": j.details, "seen_at": j.seen_at, "until": until}
                for j in self._pending
            ]
            self._pending.clear()
        if not jobs:
            return
        try:
            hand_on(self.run_dir, self.env, jobs, self.spawn)
        except Exception:
            pass  # nothing more to do for them: the run's end stands


def notice_lost(
    run_dir: Path, env: Mapping[str, str], pid: int | None, spawn: Callable[..., Any] = subprocess.Popen
) -> bool:
    """A run found lost by a command (its supervisor, pid ``pid``, died without an end): tell its
    destinations once per dead supervisor, through the detached child (the command never waits).
    True when a notice went out now."""
    from ftlaunch.run.store import read_events
    from ftlaunch.run.transitions import note

    try:
        spec = read_spec(run_dir, env)
        if "lost" not in spec.events():
            return False
        if any(e["event"] == Event.LOST_NOTICED and e.get("pid") == pid for e in read_events(run_dir)):
            return False
        note(run_dir, Event.LOST_NOTICED, pid=pid)
        msg = message(run_dir, "lost", {"supervisor_pid": pid}, env, hidden=spec.secret_values())
        msg["seen_at"] = time.time()
        wanted = [i for i in range(len(spec.destinations())) if spec.wants(i, "lost")]
        hand_on(run_dir, env, [{"target": i, "tries": 0, "msg": msg} for i in wanted], spawn)
        return True
    except Exception:  # a notice is never worth a failed `status`
        return False


def notice(
    run_dir: Path,
    env: Mapping[str, str],
    event: str,
    details: Mapping[str, Any],
    spawn: Callable[..., Any] = subprocess.Popen,
) -> bool:
    """An event seen outside the supervisor's loop (the disk forecast when a run is started, a change of
    the trainer's environment taken at an attempt's start): handed to the detached child, which builds
    the message and delivers it to each destination that chose it. Never raises, never waits; True
    when a notice went out."""
    try:
        spec = read_spec(run_dir, env)
        if event not in spec.events():
            return False
        hand_on(run_dir, env, [{"event": event, "details": dict(details), "seen_at": time.time()}], spawn)
        return True
    except Exception:  # a notice is never worth a failed start
        return False


def notice_forecast(
    run_dir: Path, env: Mapping[str, str], facts: Any, spawn: Callable[..., Any] = subprocess.Popen
) -> bool:
    """A run started with the disk forecast's warning (``StartFacts.warnings``: the run as configured
    fills the disk at step N): its destinations hear it as ``disk_forecast``."""
    if not facts.warnings:
        return False
    disk = dict(facts.disk or {})
    fill_step = dict(disk.get("verdict") or {}).get("fill_step")
    details = {"message": "; ".join(facts.warnings), "fill_step": fill_step, "filesystem": disk.get("filesystem")}
    return notice(run_dir, env, "disk_forecast", details, spawn)


def _note(run_dir: Path, event: Event, **fields: Any) -> None:
    from ftlaunch.run.transitions import note

    try:
        note(run_dir, event, **fields)
    except OSError:
        pass


def hand_on(run_dir: Path, env: Mapping[str, str], jobs: list[dict[str, Any]], spawn: Callable[..., Any]) -> None:
    """Deliveries for a detached child (``python -m ftlaunch.run.notify RUN_DIR``, the jobs on stdin):
    it reads the destinations from the run's secrets.json, so they never pass through a command line."""
    child = spawn(
        [sys.executable, "-P", "-m", "ftlaunch.run.notify", str(run_dir)],  # -P: see procs.python_module
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(env),
        start_new_session=True,
    )
    child.stdin.write(json.dumps(jobs).encode())
    child.stdin.close()


def _scrubbed(err: str, targets: Iterable[str]) -> str:
    """An error message never repeats a destination (urllib and apprise errors may quote the URL)."""
    for t in sorted(targets, key=len, reverse=True):
        body = t[4:] if t.startswith("cmd:") else t
        if len(body) >= 4:
            err = err.replace(body, redact_target(t) or "***")
    return err


def _finish_jobs(run_dir: Path, env: Mapping[str, str], jobs: list[Mapping[str, Any]]) -> None:
    """The detached child: the supervisor's leftover jobs, all at once (a slow destination delays no
    other), each retried within its deadline; returns by the last deadline (a try left behind past it
    ends with the child)."""
    n = Notifier.for_run(run_dir, env)
    work = [w for j in jobs for w in n.jobs_of(j)]
    threads = [threading.Thread(target=n.finish, args=w, name="ftlaunch-notify", daemon=True) for w in work]
    for t in threads:
        t.start()
    last = max((job.until or 0.0 for job, _ in work), default=0.0)
    for t in threads:  # a command's group gets its grace and is reaped after its deadline: a little slack
        t.join(max(0.0, last - time.time()) + LATE_S)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        jobs = json.loads(sys.stdin.read() or "[]")
    except ValueError:
        return 2
    _finish_jobs(Path(args[0]), dict(os.environ), jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
