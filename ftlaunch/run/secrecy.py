"""What is secret, the one authority: which values must never leave the user's process in clear, and
the one way text and environments are cleaned of them.

A value is secret when it is
- a value of a variable ``secret_name`` calls secret: SECRET_ENV (the trainer's credentials), any
  name with a part TOKEN, SECRET, PASSWORD, PASSWD, PASS, PASSPHRASE, KEY, API_KEY, CREDENTIAL(S),
  AUTH (MY_DB_PASSWORD, AWS_SECRET_ACCESS_KEY, OPENAI_API_KEY; not TOKENIZERS_PARALLELISM), and the
  notification settings NOTIFY_ENV (FTLAUNCH_NOTIFY: its URLs hold tokens);
- a value of a secret config key or override (``plan.config.is_secret_key``), kept in the run's
  secrets.json, and every notification destination kept there (``NOTIFY_KEY``: URLs and commands);
- the password of a URL's user part, or a query value whose name looks secret (``?token=``,
  ``&api_key=``, ``sig=``), wherever the URL is (``url_secrets``).

``env_secret_values`` and ``secret_values`` list them; ``redact`` and ``scrub`` mask them in text
(``scrub`` also masks Hugging Face token shapes, secret keys' values and secret-looking phrases in
``#`` comments, the file otherwise byte for byte); ``public_env`` masks an environment for a record;
``supervisor_env`` is what the supervisor hands any child (no notification settings); ``job_env``
is what may travel to another machine's job (Ray's runtime env): no secret name, no value holding
a secret. Used by the trainer's environment (run/trainer.py), the Ray job (run/ray/submit.py),
sbatch (run/slurm/sbatch.py), source.yaml (run/store.py), the bundle and the notifications.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

from ftlaunch.plan.config import is_secret_key

NOTIFY_KEY = "ftlaunch_notify"  # in secrets.json: the notification spec, never a trainer key

# Variables that carry the trainer's credentials: passed to the trainer, never written by ftlaunch.
SECRET_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "MODELSCOPE_API_TOKEN", "SWANLAB_API_KEY")
# The notification settings: the supervisor's alone, never a trainer's or a job's environment.
NOTIFY_ENV = ("FTLAUNCH_NOTIFY",)
NOTIFY_ENV_FIELD = "env"  # under NOTIFY_KEY: NOTIFY_ENV as a job's submission had them (keep_notify_env)

# A name part (between underscores) that makes a variable secret: HF_TOKEN, MY_DB_PASSWORD, SSH_KEY.
_SECRET_PART = re.compile(
    r"(?:^|_)(?:TOKEN|SECRET|PASSWORD|PASSWD|PASS|PASSPHRASE|KEY|APIKEY|CREDENTIALS?|AUTH|PRIVATE)(?:_|$)"
)
# A URL query parameter whose value is a credential.
_SECRET_PARAM = re.compile(r"token|secret|passw|pwd|api_?key|apikey|^key$|^sig$|signature|auth|credential", re.I)
_URL = re.compile(r"""[A-Za-z][A-Za-z0-9+.-]*://[^\s"'<>]+""")
# A list in one value (FTLAUNCH_NOTIFY's URLs, --notify-on's events): the one split, here and in run/notify.py.
LIST_SPLIT = re.compile(r"[\s,]+")
# Values too plain to mask: a secret-named flag (HF_HUB_DISABLE_IMPLICIT_TOKEN=1) is no credential.
_PLAIN = frozenset({"true", "false", "none", "null", "yes", "no", "on", "off"})

_ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=([^,\s]+)")
_HF_TOKEN = re.compile(rb"\bhf_[A-Za-z0-9]{20,}")
# `key: value`, `key=value` or `"key": "value"` where the key looks secret (plan.config.is_secret_key)
_KEY_VALUE = re.compile(rb"""(["']?)([A-Za-z0-9_.-]+)\1(\s*[:=]\s*)(["']?)([^\s"',}]+)\4""")
# In a `#` comment (anywhere after a line's first `#`): a secret-looking word, then `:` or `=`, then
# the value (`# db password: hunter2`). Searched in each comment's tail, never from every `#` to the
# line's end: that was quadratic in a line's length (a 256 KiB line of a stacks dump took 29 s).
_COMMENT_SECRET = re.compile(
    rb"(\b(?:token|secret|password|passwd|passphrase|pwd|api[ _-]?key|apikey|credentials?|auth)"
    rb"[\"']?[ \t]*[:=][ \t]*)([^\s\"',}]+)",
    re.I,
)


def secret_name(name: str) -> bool:
    """Whether a variable named ``name`` holds a secret (its value is never carried nor written)."""
    return name in SECRET_ENV or name in NOTIFY_ENV or bool(_SECRET_PART.search(name.upper()))


def _maskable(value: str) -> bool:
    """Long enough and not a flag or a number: masking ``1`` or ``true`` everywhere would hide nothing."""
    v = value.strip()
    return len(v) >= 4 and v.lower() not in _PLAIN and not v.isdigit()


def url_secrets(text: str) -> list[str]:
    """The credentials in the URLs of ``text``: each user part's password, and each query value whose
    name looks secret (``?token=abc`` gives ``abc``)."""
    found: list[str] = []
    for url in _URL.findall(text):
        try:
            parts = urllib.parse.urlsplit(url)
            password = parts.password
        except ValueError:
            continue
        if password:
            found += [password, urllib.parse.unquote(password)]
        for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=False):
            if _SECRET_PARAM.search(key):
                found += [value, urllib.parse.quote(value, safe="")]
    return [v for v in dict.fromkeys(found) if _maskable(v)]


def holds_secret(text: str) -> bool:
    """Whether ``text`` (an option, a command line) holds a secret in itself: ``NAME=value`` with a
    secret name (``--export=ALL,HF_TOKEN=...``), a URL credential or a Hugging Face token shape."""
    named = any(secret_name(k) and _maskable(v) for k, v in _ASSIGN.findall(text))
    return named or bool(url_secrets(text)) or bool(_HF_TOKEN.search(text.encode()))


def env_secret_values(env: Mapping[str, str]) -> list[str]:
    """Every secret an environment holds: the values of its secret names (each FTLAUNCH_NOTIFY URL
    too) and the URL credentials in any of its values; longest first."""
    found: list[str] = []
    for name, value in env.items():
        if not value:
            continue
        if secret_name(name):
            found += [value, *LIST_SPLIT.split(value)] if name in NOTIFY_ENV else [value]
        found += url_secrets(value)
    return _longest_first(found)


def secret_values(secrets: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """Every string a file or message must not hold: secrets.json's values (nested lists and objects
    too; of the notification spec, the destinations), the URL credentials in them, and
    ``env_secret_values(env)``; longest first, so a token inside a URL is masked whole."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, Mapping):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif value is not None and not isinstance(value, bool):
            found.append(str(value))

    walk({k: v for k, v in secrets.items() if k != NOTIFY_KEY})
    notify = secrets.get(NOTIFY_KEY)
    if isinstance(notify, Mapping):  # the destinations, not the event names chosen
        walk({"urls": notify.get("urls"), "cmd": notify.get("cmd"), "routes": notify.get("routes")})
    found += [s for v in found for s in url_secrets(v)]
    return _longest_first([*found, *env_secret_values(env)])


def _longest_first(values: Iterable[str]) -> list[str]:
    return sorted({v for v in values if _maskable(v)}, key=len, reverse=True)


def redact(text: str, env: Mapping[str, str], secrets: Iterable[str] = ()) -> str:
    """``text`` with the secrets of ``env`` (``env_secret_values``) and ``secrets`` replaced by ***."""
    for value in _longest_first([*env_secret_values(env), *secrets]):
        text = text.replace(value, "***")
    return text


def scrub(data: bytes, secrets: Iterable[str]) -> bytes:
    """``data`` with every secret value, URL credential, token shape, secret key's value and secret
    phrase of a ``#`` comment replaced by ***; every other byte as it was."""
    text = data.decode("utf-8", errors="replace")
    text = redact(text, {}, [*secrets, *url_secrets(text)]).encode()
    text = _HF_TOKEN.sub(b"***", text)

    def keyed(m: re.Match[bytes]) -> bytes:
        if not is_secret_key(m.group(2).decode()) or m.group(5) in (b"***", b"null", b"None", b"~"):
            return m.group(0)
        return m.group(1) + m.group(2) + m.group(1) + m.group(3) + m.group(4) + b"***" + m.group(4)

    return _scrub_comments(_KEY_VALUE.sub(keyed, text))


def _scrub_comments(text: bytes) -> bytes:
    """``text`` with the secret phrases of its ``#`` comments masked (``_COMMENT_SECRET``), line by line."""
    if b"#" not in text:
        return text
    lines = text.split(b"\n")
    for i, line in enumerate(lines):
        at = line.find(b"#")
        if at >= 0:
            tail = _COMMENT_SECRET.sub(lambda m: m.group(0) if m.group(2) == b"***" else m.group(1) + b"***", line[at:])
            lines[i] = line[:at] + tail
    return b"\n".join(lines)


def kept_notify_env(secrets: Mapping[str, Any]) -> dict[str, str]:
    """The notification settings a job's submission kept in secrets.json (``keep_notify_env``)."""
    spec = secrets.get(NOTIFY_KEY)
    kept = spec.get(NOTIFY_ENV_FIELD) if isinstance(spec, Mapping) else None
    return {k: str(v) for k, v in (kept or {}).items() if k in NOTIFY_ENV and v} if isinstance(kept, Mapping) else {}


def keep_notify_env(secrets: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """``secrets`` with ``env``'s notification settings kept under the notification spec, for a
    supervisor that starts in a job whose environment must not carry them (Ray, Slurm)."""
    given = {k: env[k] for k in NOTIFY_ENV if env.get(k)}
    if not given:
        return dict(secrets)
    spec = secrets.get(NOTIFY_KEY)
    return {**secrets, NOTIFY_KEY: {**(spec if isinstance(spec, Mapping) else {}), NOTIFY_ENV_FIELD: given}}


def with_kept_notify_env(secrets: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the kept notification settings where it has none of its own (a job's supervisor)."""
    return {**kept_notify_env(secrets), **{k: v for k, v in env.items() if v or k not in NOTIFY_ENV}}


def public_env(env: Mapping[str, str]) -> dict[str, str]:
    """An environment as it may be stored or shown: a secret name's value is ***."""
    return {k: ("***" if secret_name(k) else v) for k, v in env.items()}


def supervisor_env(env: Mapping[str, str]) -> dict[str, str]:
    """What the supervisor hands a child it starts (the trainer, its preflight): all of ``env`` but
    the notification settings, which stay with the supervisor (the trainer needs no destination)."""
    return {k: v for k, v in env.items() if k not in NOTIFY_ENV}


def job_env(env: Mapping[str, str], secrets: Iterable[str] = ()) -> dict[str, str]:
    """The variables of ``env`` that may be shown to whoever sees a job on another machine (Ray's
    runtime env is in the dashboard): none with a secret name, none whose value holds a secret of
    ``env`` or of ``secrets`` (a URL's password, a token inside a longer value)."""
    known = _longest_first([*env_secret_values(env), *secrets])
    return {
        k: v for k, v in env.items() if not secret_name(k) and not url_secrets(v) and not any(s in v for s in known)
    }
