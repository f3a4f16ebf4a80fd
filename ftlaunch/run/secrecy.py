"""What must never leave a run folder in clear, and the one way text is cleaned of it.

``secret_values``: every value of the run's secrets.json (nested ones too; of the notification spec
under ``NOTIFY_KEY`` only the destinations) and the secret variables of an environment. ``scrub``:
``run.trainer.redact`` (what the supervisor does to train.log) with those values, plus Hugging Face
token shapes and secret-looking keys' values in YAML/JSON lines. Used by the support bundle
(run/bundle.py) and the notifications (run/notify.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from ftlaunch.plan.config import is_secret_key
from ftlaunch.run.trainer import SECRET_ENV, redact

NOTIFY_KEY = "ftlaunch_notify"  # in secrets.json: the notification spec, never a trainer key

_HF_TOKEN = re.compile(rb"\bhf_[A-Za-z0-9]{20,}")
# `key: value`, `key=value` or `"key": "value"` where the key looks secret (plan.config.is_secret_key)
_KEY_VALUE = re.compile(rb"""(["']?)([A-Za-z0-9_.-]+)\1(\s*[:=]\s*)(["']?)([^\s"',}]+)\4""")


def secret_values(secrets: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """Every string a bundle must not hold: secrets.json's values (nested lists and objects too) and
    the secret variables of ``env``; longest first, so a token inside a URL is masked whole."""
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
        walk({"urls": notify.get("urls"), "cmd": notify.get("cmd")})
    found += [env[k] for k in SECRET_ENV if env.get(k)]
    return sorted({v for v in found if len(v) >= 4}, key=len, reverse=True)


def scrub(data: bytes, secrets: Iterable[str]) -> bytes:
    """``data`` with every secret value, token shape and secret key's value replaced by ***."""
    text = redact(data.decode("utf-8", errors="replace"), {}, secrets).encode()
    text = _HF_TOKEN.sub(b"***", text)

    def keyed(m: re.Match[bytes]) -> bytes:
        if not is_secret_key(m.group(2).decode()) or m.group(5) in (b"***", b"null", b"None", b"~"):
            return m.group(0)
        return m.group(1) + m.group(2) + m.group(1) + m.group(3) + m.group(4) + b"***" + m.group(4)

    return _KEY_VALUE.sub(keyed, text)
