"""Which hub or mirror to download from: explicit mirror > HF_ENDPOINT > USE_MODELSCOPE_HUB > probe."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlparse

from ftlaunch.plan.flags import truthy

from ..errors import ConfigError

KNOWN_ENDPOINTS: dict[str, str] = {"hf": "https://huggingface.co", "hf-mirror": "https://hf-mirror.com"}
MODELSCOPE = "modelscope"  # handled separately: downloaded by the modelscope package, not huggingface_hub
DEFAULT_CANDIDATES: tuple[str, ...] = ("hf", "hf-mirror")


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
    if truthy(env.get("USE_MODELSCOPE_HUB")):
        return EndpointChoice(MODELSCOPE, None, "USE_MODELSCOPE_HUB is set", use_modelscope=True)

    resolved = [_candidate(c) for c in candidates]
    if not resolved:
        raise ConfigError("no endpoint candidates to probe")
    if truthy(env.get("HF_HUB_OFFLINE")):
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""
