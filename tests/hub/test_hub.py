"""ftlaunch.hub against the REAL huggingface_hub client talking to a local fake hub (tests/fakehub.py).

No mocks of the client: faults are injected at the HTTP level. Every test runs with HF_HOME/HF token paths in
tmp_path and a socket guard that refuses anything but loopback, so nothing can reach the internet or read the
real home. Backoff sleeps are injected (recorded, not slept).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import random
import socket
import time
from pathlib import Path

import httpx
import pytest
from filelock import FileLock

from ftlaunch.errors import BusyError, ConfigError, ExitCode, HubError, NetworkError, VerifyError
from ftlaunch.hub import (
    KNOWN_ENDPOINTS,
    DownloadResult,
    choose_endpoint,
    clear_stale_locks,
    download,
    offline_env,
    verify_snapshot,
)

try:  # tests/ may or may not be a package, depending on how the suite is laid out
    from tests.fakehub import FakeHub
except ImportError:  # pragma: no cover
    from fakehub import FakeHub  # type: ignore[no-redef]

TOKEN = "hf_FtlaunchTestTokenDoNotLeak1234567890"
REPO = "org/tiny"
CONFIG = b'{"model_type": "llama", "hidden_size": 64}'
TOKENIZER = b'{"version": "1.0", "model": {"type": "BPE"}}' * 20
WEIGHTS = random.Random(0).randbytes(3 * 1024 * 1024 + 123)  # LFS (by suffix), served through the "CDN"
TINY_FILES = {"config.json": CONFIG, "tokenizer.json": TOKENIZER, "model.safetensors": WEIGHTS}


def _sharded_files() -> dict[str, bytes]:
    shards = {f"model-0000{i}-of-00002.safetensors": random.Random(i).randbytes(200_000) for i in (1, 2)}
    index = {
        "metadata": {"total_size": 400_000},
        "weight_map": {"a.weight": next(iter(shards)), "b.weight": list(shards)[1]},
    }
    return {"config.json": CONFIG, "model.safetensors.index.json": json.dumps(index).encode(), **shards}


# ------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True)
def isolated_hf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    home = tmp_path / "hf_home"
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    # huggingface_hub froze these at import time: point them at tmp as well.
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    real_create_connection = socket.create_connection

    def loopback_only(address, *args, **kwargs):  # type: ignore[no-untyped-def]
        if address[0] not in ("127.0.0.1", "localhost", "::1"):
            raise OSError(f"test tried to reach {address[0]}: only the local fake hub is allowed")
        return real_create_connection(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", loopback_only)


@pytest.fixture
def hub() -> FakeHub:
    with FakeHub({REPO: TINY_FILES, "org/sharded": _sharded_files()}) as fake:
        yield fake


class Recorder:
    """Collects on_retry calls and the backoff waits that download() asked for."""

    def __init__(self) -> None:
        self.retries: list[tuple[int, int, BaseException, float]] = []
        self.sleeps: list[float] = []

    def on_retry(self, n: int, max_retries: int, exc: BaseException, wait: float) -> None:
        self.retries.append((n, max_retries, exc, wait))

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


def dl(hub: FakeHub, tmp_path: Path, rec: Recorder, repo: str = REPO, **kwargs: object) -> DownloadResult:
    kwargs.setdefault("timeout", 5.0)
    return download(
        repo,
        endpoint=hub.url,
        cache_dir=tmp_path / "cache",
        progress=False,
        on_retry=rec.on_retry,
        sleep=rec.sleep,
        **kwargs,  # type: ignore[arg-type]
    )


def closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there any more: connections are refused at once
    return f"http://127.0.0.1:{port}"


def chain_text(exc: BaseException) -> str:
    parts = []
    e: BaseException | None = exc
    while e is not None:
        parts.append(f"{e!s} {e!r} {getattr(e, 'hint', '')}")
        e = e.__cause__ or e.__context__
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------------- the fake hub itself
def test_fakehub_speaks_the_protocol_plain_snapshot_download(hub: FakeHub, tmp_path: Path) -> None:
    from huggingface_hub import snapshot_download

    path = Path(snapshot_download(REPO, endpoint=hub.url, cache_dir=tmp_path / "plain"))
    assert (path / "model.safetensors").read_bytes() == WEIGHTS
    assert (path / "config.json").read_bytes() == CONFIG
    head = hub.requests_for("/org/tiny/resolve/*/model.safetensors", "HEAD")[0]
    assert head.status == 302  # LFS file: redirect to the "CDN", like the hub
    cdn = hub.requests_for("/__cdn__/*", "GET")
    assert len(cdn) == 1 and "authorization" not in cdn[0].headers
    # The LFS blob is stored under its sha256 (X-Linked-Etag), proving the client read our headers.
    assert (tmp_path / "plain" / "models--org--tiny" / "blobs" / hashlib.sha256(WEIGHTS).hexdigest()).is_file()


# ------------------------------------------------------------------------------------------------- download
def test_clean_download_pins_commit_writes_ref_and_verifies(hub: FakeHub, tmp_path: Path, rec: Recorder) -> None:
    res = dl(hub, tmp_path, rec)
    commit = hub.repos[REPO].commit
    assert (res.retries, res.resumes, res.files, res.commit) == (0, 0, 3, commit)
    assert res.bytes == len(CONFIG) + len(TOKENIZER) + len(WEIGHTS)
    assert res.endpoint == hub.url and res.revision is None
    assert Path(res.path).name == commit
    assert (Path(res.path) / "model.safetensors").read_bytes() == WEIGHTS
    storage = tmp_path / "cache" / "models--org--tiny"
    assert (storage / "refs" / "main").read_text() == commit
    # The one listing call carries blobs=True (sizes + sha256 for verification); no second repo-info call.
    infos = hub.requests_for("/api/models/org/tiny*", "GET")
    assert [r.query for r in infos if "/tree/" not in r.path] == ["blobs=True".lower()]
    assert rec.retries == [] and rec.sleeps == []

    # Loading by repo id offline works thanks to refs/main.
    from huggingface_hub import try_to_load_from_cache

    assert try_to_load_from_cache(REPO, "config.json", cache_dir=tmp_path / "cache") == str(
        Path(res.path) / "config.json"
    )

    # A second call downloads nothing.
    before = dict(hub.bytes_served)
    again = dl(hub, tmp_path, rec)
    assert again.path == res.path and dict(hub.bytes_served) == before


def test_503_then_success_retries_once_and_keeps_finished_files(hub: FakeHub, tmp_path: Path, rec: Recorder) -> None:
    hub.fail_next("*model.safetensors", status=503, method="GET")
    res = dl(hub, tmp_path, rec)
    assert res.retries == 1
    [(n, max_retries, exc, wait)] = rec.retries
    assert (n, max_retries) == (1, 5)
    assert "503" in str(exc)
    assert 1.0 <= wait <= 2.0 and rec.sleeps == [wait]  # exponential backoff: 1s plus up to 1s of jitter
    served = hub.bytes_served
    assert served["org/tiny/model.safetensors"] == len(WEIGHTS)
    assert served["org/tiny/config.json"] == len(CONFIG)  # finished in attempt 1, not fetched again


def test_429_honours_retry_after(hub: FakeHub, tmp_path: Path, rec: Recorder) -> None:
    hub.fail_next("/api/models/*", status=429, retry_after=7)
    res = dl(hub, tmp_path, rec)
    assert res.retries == 1 and rec.sleeps == [7.0]


@pytest.mark.parametrize("reset", [False, True], ids=["FIN", "RST"])
def test_dropped_connection_resumes_only_the_rest(hub: FakeHub, tmp_path: Path, rec: Recorder, reset: bool) -> None:
    cut = len(WEIGHTS) // 3
    hub.drop_after("*model.safetensors", cut, reset=reset)
    res = dl(hub, tmp_path, rec)
    assert (Path(res.path) / "model.safetensors").read_bytes() == WEIGHTS
    assert res.retries == 0 and res.resumes == 1
    served = hub.bytes_served["org/tiny/model.safetensors"]
    assert len(WEIGHTS) <= served <= len(WEIGHTS) + 64 * 1024, served  # not 2x: only the rest was re-requested
    ranged = [r for r in hub.requests_for("*model.safetensors", "GET") if r.status == 206]
    assert len(ranged) == 1 and ranged[0].range.startswith("bytes=") and not ranged[0].range.startswith("bytes=0-")
    assert ranged[0].headers.get("if-range") == f'"{hashlib.sha256(WEIGHTS).hexdigest()}"'


def test_reset_on_server_without_range_support_is_left_to_huggingface_hub(tmp_path: Path, rec: Recorder) -> None:
    # No Range support: nothing to splice; the reset is shown to huggingface_hub as an early close, which it
    # recovers from by itself (restarting that file) instead of failing the whole attempt.
    cut = len(WEIGHTS) // 3
    with FakeHub({REPO: TINY_FILES}, ranges=False) as plain_server:
        plain_server.drop_after("*model.safetensors", cut, reset=True)
        res = dl(plain_server, tmp_path, rec)
        assert (Path(res.path) / "model.safetensors").read_bytes() == WEIGHTS
        assert (res.retries, res.resumes) == (0, 0)
        assert plain_server.bytes_served["org/tiny/model.safetensors"] == len(WEIGHTS) + cut


def test_slow_server_times_out_then_retry_succeeds(hub: FakeHub, tmp_path: Path, rec: Recorder) -> None:
    hub.delay("/api/models/org/tiny", 5.0, times=1)
    t0 = time.monotonic()
    res = dl(hub, tmp_path, rec, timeout=0.5)
    assert time.monotonic() - t0 < 4
    assert res.retries == 1
    assert isinstance(rec.retries[0][2], httpx.TimeoutException)


def test_call_without_timeout_in_huggingface_hub_is_capped(hub: FakeHub, tmp_path: Path, rec: Recorder) -> None:
    # huggingface_hub lists the repo tree with timeout=None; a stalled server must not hang the run.
    hub.delay("/api/models/org/tiny/tree/*", 5.0, times=1)
    t0 = time.monotonic()
    res = dl(hub, tmp_path, rec, timeout=0.5)
    assert time.monotonic() - t0 < 4
    assert res.retries == 1


@pytest.mark.parametrize("status", [401, 403, 404])
def test_refused_repo_is_hub_error_without_retry(hub: FakeHub, tmp_path: Path, rec: Recorder, status: int) -> None:
    hub.status_for_repo(REPO, status)
    with pytest.raises(HubError) as info:
        dl(hub, tmp_path, rec, token=TOKEN)
    err = info.value
    assert err.exit_code == ExitCode.HUB
    assert "hf auth login" in str(err) and "HF_TOKEN" in str(err)
    assert f"HTTP {status}" in str(err)
    assert TOKEN not in chain_text(err)
    assert rec.retries == [] and rec.sleeps == []
    assert [(r.method, r.path) for r in hub.requests] == [("GET", "/api/models/org/tiny")]
    assert hub.requests[0].headers["authorization"] == f"Bearer {TOKEN}"  # the token was used, just not shown


def test_unknown_repo_and_revision(hub: FakeHub, tmp_path: Path, rec: Recorder) -> None:
    with pytest.raises(HubError, match="was not found"):
        dl(hub, tmp_path, rec, repo="org/does-not-exist")
    with pytest.raises(HubError, match="revision 'nope'"):
        dl(hub, tmp_path, rec, revision="nope")
    assert len(hub.requests) == 2 and rec.retries == []


def test_retries_exhausted_is_network_error(hub: FakeHub, tmp_path: Path, rec: Recorder) -> None:
    hub.fail_next("/api/models/*", status=502, times=100)
    with pytest.raises(NetworkError) as info:
        dl(hub, tmp_path, rec, max_attempts=3, token=TOKEN)
    assert info.value.exit_code == ExitCode.NETWORK
    assert "after 3 attempt(s)" in str(info.value) and "HTTP 502" in str(info.value)
    assert [(n, m) for n, m, _, _ in rec.retries] == [(1, 2), (2, 2)]
    assert len(hub.requests) == 3
    assert TOKEN not in chain_text(info.value)


def test_unreachable_endpoint_is_network_error(tmp_path: Path, rec: Recorder) -> None:
    with pytest.raises(NetworkError, match="connection problem"):
        download(
            REPO,
            endpoint=closed_port_url(),
            cache_dir=tmp_path / "c",
            progress=False,
            max_attempts=2,
            sleep=rec.sleep,
            on_retry=rec.on_retry,
        )
    assert len(rec.retries) == 1


def test_corrupt_file_is_verify_error_and_is_refetched_next_time(hub: FakeHub, tmp_path: Path, rec: Recorder) -> None:
    hub.corrupt("org/tiny/model.safetensors")
    with pytest.raises(VerifyError) as info:
        dl(hub, tmp_path, rec)
    assert info.value.exit_code == ExitCode.VERIFY
    assert "model.safetensors" in str(info.value) and "sha256" in str(info.value)
    assert info.value.problems == [p for p in info.value.problems if "model.safetensors" in p]
    snapshot = tmp_path / "cache" / "models--org--tiny" / "snapshots" / hub.repos[REPO].commit
    assert not (snapshot / "model.safetensors").exists()  # removed, so the next run fetches it again
    assert (snapshot / "config.json").exists()

    hub.clear_faults()
    res = dl(hub, tmp_path, rec)
    assert (Path(res.path) / "model.safetensors").read_bytes() == WEIGHTS
    assert hub.bytes_served["org/tiny/model.safetensors"] == 2 * len(WEIGHTS)
    assert hub.bytes_served["org/tiny/config.json"] == len(CONFIG)


def test_sharded_repo_and_missing_shard(hub: FakeHub, tmp_path: Path, rec: Recorder) -> None:
    res = dl(hub, tmp_path, rec, repo="org/sharded")
    assert res.files == 4
    with pytest.raises(VerifyError, match=r"lists model-00002-of-00002\.safetensors, which is missing"):
        dl(hub, tmp_path / "other", rec, repo="org/sharded", ignore_patterns=["*00002*"])


def test_verify_snapshot_lists_every_problem(tmp_path: Path) -> None:
    snap = tmp_path / "models--o--r" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    blobs = tmp_path / "models--o--r" / "blobs"
    blobs.mkdir()
    (snap / "ok.json").write_bytes(b"{}")
    (snap / "short.bin").write_bytes(b"123")
    (snap / "bad.safetensors").write_bytes(b"abcd")
    expected = [
        ("ok.json", 2, None),
        ("short.bin", 10, None),
        ("bad.safetensors", 4, hashlib.sha256(b"dcba").hexdigest()),
        ("gone.txt", 1, None),
    ]
    verify_snapshot(snap, expected[:1])  # the good part alone passes
    (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "shard-2.safetensors"}}))
    (blobs / "deadbeef.0123abcd.incomplete").write_bytes(b"x")
    with pytest.raises(VerifyError) as info:
        verify_snapshot(snap, expected)
    problems = info.value.problems
    assert len(problems) == 5, problems
    text = str(info.value)
    for needle in (
        "short.bin: size 3",
        "bad.safetensors: sha256",
        "gone.txt: missing",
        "shard-2.safetensors",
        "deadbeef.0123abcd.incomplete",
    ):
        assert needle in text


def test_token_never_in_result_logs_or_cdn_requests(
    hub: FakeHub, tmp_path: Path, rec: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    hub.fail_next("*model.safetensors", status=500, method="GET")
    with caplog.at_level(logging.DEBUG):
        res = dl(hub, tmp_path, rec, token=TOKEN)
    assert res.retries == 1
    assert TOKEN not in json.dumps(res.to_dict()) and TOKEN not in repr(res)
    assert TOKEN not in caplog.text
    assert TOKEN not in str(rec.retries[0][2])
    hub_side = [r for r in hub.requests if not r.path.startswith("/__cdn__/")]
    assert all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in hub_side)
    assert all("authorization" not in r.headers for r in hub.requests_for("/__cdn__/*"))


def test_client_and_progress_settings_are_restored(hub: FakeHub, tmp_path: Path, rec: Recorder) -> None:
    from huggingface_hub.utils import _http, are_progress_bars_disabled

    factory, bars = _http._GLOBAL_CLIENT_FACTORY, are_progress_bars_disabled()
    dl(hub, tmp_path, rec)
    assert _http._GLOBAL_CLIENT_FACTORY is factory and are_progress_bars_disabled() == bars


# ------------------------------------------------------------------------------------------------- locks and leftovers
def test_stale_lock_cleared_live_lock_respected(hub: FakeHub, tmp_path: Path, rec: Recorder) -> None:
    cache = tmp_path / "cache"
    locks = cache / ".locks" / "models--org--tiny"
    locks.mkdir(parents=True)
    stale, live = locks / "stale.lock", locks / "live.lock"
    stale.touch()
    held = FileLock(str(live))
    held.acquire()
    try:
        assert clear_stale_locks(cache) == [stale]
        assert not stale.exists() and live.exists()

        with pytest.raises(BusyError, match="another process is downloading org/tiny"):
            dl(hub, tmp_path, rec, lock_timeout=2.0)
        assert rec.sleeps == [0.5] * 4  # waited in steps, then gave up
        assert hub.requests == []  # nothing was requested while the lock was held
    finally:
        held.release()
    assert dl(hub, tmp_path, rec).files == 3


def test_clear_stale_locks_with_injected_liveness(tmp_path: Path) -> None:
    locks = tmp_path / ".locks" / "models--a--b"
    locks.mkdir(parents=True)
    for name in ("dead.lock", "alive.lock"):
        (locks / name).touch()
    removed = clear_stale_locks(tmp_path, is_alive=lambda p: p.name == "alive.lock")
    assert removed == [locks / "dead.lock"] and (locks / "alive.lock").exists()
    assert clear_stale_locks(tmp_path / "nothing-here") == []


def test_orphaned_partial_files_are_swept(hub: FakeHub, tmp_path: Path, rec: Recorder) -> None:
    blobs = tmp_path / "cache" / "models--org--tiny" / "blobs"
    blobs.mkdir(parents=True)
    orphan = blobs / f"{hashlib.sha256(WEIGHTS).hexdigest()}.0badc0de.incomplete"  # a killed 1.x download
    legacy = blobs / f"{hashlib.sha256(WEIGHTS).hexdigest()}.incomplete"  # resumable by older versions
    orphan.write_bytes(WEIGHTS[:1000])
    legacy.write_bytes(WEIGHTS[:1000])
    res = dl(hub, tmp_path, rec)  # verification would fail on any leftover *.incomplete
    assert not orphan.exists() and not legacy.exists()
    assert res.files == 3


# ------------------------------------------------------------------------------------------------- endpoint choice
def test_auto_picks_second_endpoint_when_first_does_not_answer(hub: FakeHub) -> None:
    dead = closed_port_url()
    choice = choose_endpoint(REPO, None, {}, candidates=[("first", dead), ("second", hub.url)], timeout=1.0)
    assert (choice.name, choice.url, choice.use_modelscope) == ("second", hub.url, False)
    assert f"{dead.split('//')[1]} could not be reached" in choice.reason
    assert choice.reason.endswith("answered 200")


def test_auto_probe_timeout_5xx_and_404(hub: FakeHub) -> None:
    with FakeHub({REPO: {"config.json": CONFIG}}) as slow:
        slow.delay("/api/models/*", 3.0)
        choice = choose_endpoint(REPO, "auto", {}, candidates=[("slow", slow.url), ("ok", hub.url)], timeout=0.3)
        assert choice.name == "ok" and "did not answer in 0.3s" in choice.reason
    hub.fail_next("/api/models/*", status=503)
    choice = choose_endpoint(REPO, "auto", {}, candidates=[("a", hub.url), ("b", hub.url)])
    assert choice.name == "b" and "answered 503" in choice.reason
    # 404 = reachable but missing: take it (the download then reports the bad repo id), don't hop mirrors.
    choice = choose_endpoint("org/nope", "auto", {}, candidates=[("a", hub.url), ("b", closed_port_url())])
    assert choice.name == "a" and "404" in choice.reason


def test_auto_with_injected_probe_and_nothing_answering() -> None:
    calls: list[tuple[str, str]] = []

    def probe(url: str, repo_id: str) -> bool:
        calls.append((url, repo_id))
        return False

    choice = choose_endpoint(REPO, None, {}, probe=probe)
    assert calls == [(KNOWN_ENDPOINTS["hf"], REPO), (KNOWN_ENDPOINTS["hf-mirror"], REPO)]
    assert choice.url == KNOWN_ENDPOINTS["hf"] and choice.reason.startswith("no endpoint answered")
    choice = choose_endpoint(REPO, None, {}, probe=lambda url, repo: "mirror" in url)
    assert choice.name == "hf-mirror" and choice.reason == "huggingface.co did not answer; hf-mirror.com answered"


def test_precedence_explicit_then_env_then_probe() -> None:
    def no_probe(url: str, repo_id: str) -> bool:
        raise AssertionError("must not probe")

    env = {"HF_ENDPOINT": "https://env.example.com/"}
    explicit = choose_endpoint(REPO, "https://my.mirror.local/", env, probe=no_probe)
    assert (explicit.name, explicit.url) == ("custom", "https://my.mirror.local")
    assert choose_endpoint(REPO, "hf-mirror", env, probe=no_probe).url == "https://hf-mirror.com"
    assert choose_endpoint(REPO, "HF", env, probe=no_probe).url == "https://huggingface.co"
    from_env = choose_endpoint(REPO, "auto", env, probe=no_probe)
    assert from_env.url == "https://env.example.com" and "HF_ENDPOINT is set" in from_env.reason
    assert choose_endpoint(REPO, None, {"HF_ENDPOINT": "https://hf-mirror.com"}, probe=no_probe).name == "hf-mirror"
    ms = choose_endpoint(REPO, "modelscope", env, probe=no_probe)
    assert ms.use_modelscope and ms.url is None
    assert choose_endpoint(REPO, None, {"USE_MODELSCOPE_HUB": "1"}, probe=no_probe).use_modelscope
    assert "not probing" in choose_endpoint(REPO, None, {"HF_HUB_OFFLINE": "1"}, probe=no_probe).reason
    with pytest.raises(ConfigError):
        choose_endpoint(REPO, "my-mirror", {}, probe=no_probe)
    with pytest.raises(ConfigError):
        choose_endpoint(REPO, None, {"HF_ENDPOINT": "ftp://x"}, probe=no_probe)


# ------------------------------------------------------------------------------------------------- misc
def test_offline_env() -> None:
    assert offline_env() == {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def test_modelscope_without_package_is_hub_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec  # modelscope.py asks importlib.util, the one module object
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "modelscope" else real_find_spec(name, *a)
    )
    with pytest.raises(HubError, match="'modelscope' package is not installed") as info:
        download(REPO, endpoint="modelscope", cache_dir=tmp_path)
    assert "pip install modelscope" in (info.value.hint or "")


def test_bad_endpoint_is_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        download(REPO, endpoint="not a url", cache_dir=tmp_path)


def test_offline_mode_is_network_error_without_retry(
    hub: FakeHub, tmp_path: Path, rec: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(NetworkError, match="offline mode is on"):
        dl(hub, tmp_path, rec)
    assert rec.retries == [] and hub.requests == []


def test_invalid_repo_id_is_hub_error(hub: FakeHub, tmp_path: Path, rec: Recorder) -> None:
    with pytest.raises(HubError, match="not a valid repo id"):
        dl(hub, tmp_path, rec, repo="org/two/slashes")
    assert hub.requests == []
