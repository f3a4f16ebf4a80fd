"""The preflight: LLaMA-Factory's own argument parsing of the adapted config, before anything starts.

``preflight(plan, env)`` (the shell `train` and `plan --check` call) hands the config ftlaunch would
write as config.yaml, secrets included, with the env the trainer would get, to ``preflight_child.py``
run by path in the trainer's Python (the interpreter of llamafactory-cli's shebang), where the plan's
card is emulated. A refusal is a ConfigError (exit 3) carrying LLaMA-Factory's message verbatim; no trainer
and no run folder exist yet. A verdict is cached per (config, env, card, trainer packages) under
FTLAUNCH_HOME/cache/preflight/, so a second `train` of the same config costs a file read. Each child
started is one line of children.jsonl there (what the preflight cost, and proof that the cache held).

``check_configs`` is the batch form: many (config, env, card) items parsed by ONE child (the test over
LLaMA-Factory's examples tree). What is decided here (``card_of``, ``parse_env``, ``cache_key``,
``verdict_of``) are plain functions over data; the spawning is ``run_child``. Method: docs/preflight.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftlaunch.errors import ConfigError, TrainerError
from ftlaunch.files import home, now_iso, write_json_atomic
from ftlaunch.plan.config import dump_yaml, split_secrets
from ftlaunch.plan.hardware import Hardware
from ftlaunch.plan.planner import Plan
from ftlaunch.run.trainer import SECRET_ENV, find_trainer, redact, trainer_env

CHILD = Path(__file__).with_name("preflight_child.py")
DEFAULT_TIMEOUT = 180.0

# What llamafactory-cli's launcher and parsers read from the environment (launcher.py, extras/misc.py,
# hparams/parser.py, accelerate's state): the only variables that can change a verdict.
PARSE_VARS = (
    "FORCE_TORCHRUN",
    "NPROC_PER_NODE",
    "NNODES",
    "NODE_RANK",
    "MASTER_ADDR",
    "USE_V1",
    "USE_MCA",
    "USE_RAY",
    "USE_KT",
    "ALLOW_EXTRA_ARGS",
    "ALLOW_EXTRA_KEYS",
    "DISABLE_VERSION_CHECK",
    "USE_MODELSCOPE_HUB",
    "USE_OPENMIND_HUB",
)
_TRAINER_PACKAGES = ("llamafactory", "transformers", "accelerate", "torch", "deepspeed", "peft", "trl", "datasets")


@dataclass(frozen=True)
class Verdict:
    """What the preflight found. ``status``: ok | refused | skipped (no verdict: why in ``message``)."""

    status: str
    message: str | None = None
    cached: bool = False
    seconds: float = 0.0
    llamafactory: str | None = None
    where: str | None = None
    exception: str | None = None
    assumed: tuple[str, ...] = ()  # packages taken as installed on a machine that is not this one

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def line(self) -> str:
        lf = f"LLaMA-Factory {self.llamafactory}" if self.llamafactory else "LLaMA-Factory"
        how = "cached verdict" if self.cached else f"{self.seconds:.1f} s"
        if self.status == "ok":
            also = f"; taken as installed there: {', '.join(self.assumed)}" if self.assumed else ""
            return f"preflight: {lf}'s argument parser accepts the adapted config ({how}{also})"
        if self.status == "refused":
            return f"preflight: {lf} refuses the adapted config: {self.message}"
        return f"preflight skipped: {self.message}"


# ---------------------------------------------------------------- pure decisions


def card_of(hw: Hardware) -> dict[str, Any] | None:
    """The card the child emulates: the plan's GPUs (name, count, compute capability, memory), or None."""
    if not hw.gpus:
        return None
    g = hw.gpus[0]
    return {
        "name": g.name,
        "count": len(hw.gpus),
        "cc": list(g.compute_capability) if g.compute_capability else None,
        "total_mib": g.total_mib,
        "driver": hw.driver_version,
    }


def parse_env(env: Mapping[str, str], plan_env: Mapping[str, str]) -> dict[str, str]:
    """The variables of the trainer's environment (caller's + plan's) that llamafactory-cli's launcher and
    parser read. CUDA_VISIBLE_DEVICES only from the plan: the caller's was already applied by the probe."""
    merged = trainer_env(env, plan_env)
    out = {k: merged[k] for k in PARSE_VARS if k in merged}
    out.update({k: v for k, v in merged.items() if k.startswith("ACCELERATE_")})
    if "CUDA_VISIBLE_DEVICES" in plan_env:
        out["CUDA_VISIBLE_DEVICES"] = plan_env["CUDA_VISIBLE_DEVICES"]
    return dict(sorted(out.items()))


def config_text(p: Plan) -> str:
    """What the trainer reads: config.yaml with its secrets (the supervisor's 0600 copy)."""
    return dump_yaml(p.config, p.header)


def child_item(item_id: str, p: Plan, env: Mapping[str, str]) -> dict[str, Any]:
    """One config for a batch of the parser child (``check_configs``): what it reads, the parse env
    and the card it emulates."""
    return {"id": item_id, "yaml": config_text(p), "env": parse_env(env, p.env), "card": card_of(p.hardware)}


def cache_key(
    text: str, penv: Mapping[str, str], card: Mapping[str, Any] | None, fingerprint: str, assume: bool = False
) -> str:
    """sha256 over the config (secret values masked), the parse env, the card and the trainer's packages."""
    payload = json.dumps(
        {"config": text, "env": dict(penv), "card": card, "trainer": fingerprint, "assume_packages": assume},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def verdict_of(result: Mapping[str, Any], llamafactory: str | None, seconds: float) -> Verdict:
    """One child result -> a Verdict ("error": the emulation failed, so no verdict: skipped)."""
    status = result.get("verdict")
    assumed = tuple(dict.fromkeys(result.get("assumed") or ()))
    if status == "ok":
        return Verdict("ok", seconds=seconds, llamafactory=llamafactory, assumed=assumed)
    if status == "refused":
        return Verdict(
            "refused",
            str(result.get("message")),
            seconds=seconds,
            llamafactory=llamafactory,
            where=result.get("where"),
            exception=result.get("exception"),
            assumed=assumed,
        )
    why = f"the check itself failed ({result.get('exception')}: {result.get('message')} at {result.get('where')})"
    return Verdict("skipped", why, seconds=seconds, llamafactory=llamafactory)


def refusal_error(v: Verdict) -> ConfigError:
    lf = f"LLaMA-Factory {v.llamafactory}" if v.llamafactory else "LLaMA-Factory"
    return ConfigError(
        f"{lf} refuses the adapted config (its own argument parser, as `llamafactory-cli train` would run it): "
        f"{v.message}",
        hint=f"raised by {v.exception} at {v.where}; see `ftlaunch plan CONFIG --check`, fix the key it names "
        "and train again; nothing was started",
    )


# ---------------------------------------------------------------- the trainer's Python


_IMPORTS_LF = re.compile(rb"^\s*(from|import)\s+llamafactory\b", re.M)


def find_trainer_python(env: Mapping[str, str]) -> tuple[str | None, str]:
    """(the Python llamafactory-cli runs under, by its shebang, or None; why not)."""
    try:
        exe = find_trainer(env)[0]
        head = Path(exe).read_bytes()[:4096]
    except TrainerError as exc:
        return None, f"{exc.message} (is the train extra installed?)"
    except OSError as exc:
        return None, f"the trainer cannot be read: {exc}"
    if not _IMPORTS_LF.search(head) or not head.startswith(b"#!"):
        return None, f"the trainer {exe} is not llamafactory-cli (it imports no llamafactory)"
    words = head[2:].split(b"\n", 1)[0].decode(errors="replace").split()
    if words and Path(words[0]).name == "env" and len(words) > 1:
        found = shutil.which(words[-1], path=env.get("PATH"))
    else:
        found = words[0] if words and "python" in Path(words[0]).name and Path(words[0]).is_file() else None
    return found, "" if found else f"the Python of {exe} ({' '.join(words) or 'no shebang'}) was not found"


def trainer_python(env: Mapping[str, str]) -> str | None:
    """The Python llamafactory-cli runs under (its shebang); None when the trainer is not llamafactory-cli
    (a stand-in script) or its interpreter cannot be found."""
    return find_trainer_python(env)[0]


def trainer_fingerprint(python: str) -> str:
    """The packages the trainer's Python would import, by their dist-info names (no process started)."""
    exe = Path(python)
    roots = sorted(exe.parent.parent.glob("lib/python*/site-packages"))
    if exe.resolve() == Path(sys.executable).resolve() or not roots:
        roots = [Path(p) for p in sys.path if p.endswith(("site-packages", "dist-packages"))] + roots
    names: set[str] = set()
    for root in roots:
        for pkg in _TRAINER_PACKAGES:
            names.update(d.name for d in root.glob(f"{pkg}-*.dist-info"))
    child = hashlib.sha256(CHILD.read_bytes()).hexdigest()[:16]
    return f"{python}|{','.join(sorted(names))}|child={child}"


# ---------------------------------------------------------------- the shell


def _log_path(env: Mapping[str, str]) -> Path:
    return home(env) / "cache" / "preflight" / "children.jsonl"


def run_child(
    items: Sequence[Mapping[str, Any]],
    python: str,
    env: Mapping[str, str],
    *,
    assume_packages: bool = False,
    timeout: float | None = DEFAULT_TIMEOUT,
    log: Path | None = None,
) -> tuple[dict[str, Any], float]:
    """Parse every item in ONE child (``python preflight_child.py SPEC OUT``). Returns (its output, seconds).
    The spec holds secrets: it lives in a 0700 temporary folder, 0600, removed afterwards. Raises
    TrainerError when the child cannot run or gives no output (its log's last lines say why)."""
    work = Path(tempfile.mkdtemp(prefix="ftlaunch-preflight-"))
    try:
        spec_path, out_path, log_path = work / "spec.json", work / "out.json", work / "child.log"
        spec = {"items": list(items), "assume_packages": assume_packages, "scratch": str(work / "scratch")}
        fd = os.open(spec_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(spec, f, default=str)
        child_env = {k: v for k, v in env.items() if k not in ("FORCE_TORCHRUN", "NPROC_PER_NODE")}
        child_env["CUDA_VISIBLE_DEVICES"] = ""  # parsing needs no GPU and must not take one from a run
        child_env.setdefault("LLAMAFACTORY_VERBOSITY", "WARN")
        t0 = time.monotonic()
        try:
            with open(log_path, "wb") as out:
                rc = subprocess.run(
                    [python, str(CHILD), str(spec_path), str(out_path)],
                    env=child_env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=work,
                    timeout=timeout,
                ).returncode
        except subprocess.TimeoutExpired:
            raise TrainerError(f"LLaMA-Factory's parser took longer than {timeout:.0f} s") from None
        except OSError as exc:
            raise TrainerError(f"cannot run {python}: {exc}") from None
        seconds = time.monotonic() - t0
        if log is not None:
            _append(log, {"time": now_iso(), "items": len(items), "seconds": round(seconds, 3), "rc": rc})
        if rc != 0 or not out_path.is_file():
            text = log_path.read_text(errors="replace")
            secrets = [str(v) for it in items for v in split_secrets(_yaml_values(it.get("yaml", "")))[1].values()]
            tail = redact(" | ".join(text.strip().splitlines()[-3:]), env, secrets) or f"exit {rc}"
            if "No module named 'llamafactory'" in text:
                raise TrainerError(f"{python} cannot import llamafactory")
            raise TrainerError(f"the preflight child failed (exit {rc}): {tail}")
        return json.loads(out_path.read_text()), seconds
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _yaml_values(text: str) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def _append(path: Path, record: Mapping[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(dict(record)) + "\n")
    except OSError:
        pass  # a record of cost; never a reason to refuse a run


def check_configs(
    items: Sequence[Mapping[str, Any]],
    env: Mapping[str, str],
    *,
    python: str | None = None,
    assume_packages: bool = False,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Batch form for many configs: items of {"id", "yaml", "env" (parse env), "card"}; one child, no
    cache. Returns the child's output ({"llamafactory", "results": [...]}, in item order)."""
    py = python or trainer_python(env) or sys.executable
    out, seconds = run_child(items, py, env, assume_packages=assume_packages, timeout=timeout, log=_log_path(env))
    return {**out, "seconds": seconds}


def assumes_packages(hw: Hardware) -> bool:
    """A plan for another machine (``--gpu`` from the catalog, ``--hardware FILE``) is checked as if the
    packages its config needs (deepspeed, galore_torch, ...) were installed there; this machine's are real."""
    return hw.source.startswith(("catalog:", "file:"))


def preflight(
    p: Plan,
    env: Mapping[str, str],
    *,
    assume_packages: bool | None = None,
    python: str | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    use_cache: bool = True,
    say: Callable[[str], None] = lambda _: None,
) -> Verdict:
    """Parse the plan's adapted config with LLaMA-Factory's own parser in the trainer's Python, with the
    plan's env and card. Returns the Verdict (ok, refused, or skipped with the reason, said as a warning);
    cached under FTLAUNCH_HOME/cache/preflight/. ``require(verdict)`` turns a refusal into a ConfigError.
    ``assume_packages``: default ``assumes_packages(p.hardware)``."""
    assume = assumes_packages(p.hardware) if assume_packages is None else assume_packages
    py, why = (python, "") if python else find_trainer_python(env)
    if py is None:
        v = Verdict("skipped", why)
        say(v.line())
        return v
    text = config_text(p)
    penv = parse_env(env, p.env)
    card = card_of(p.hardware)
    _, secrets = split_secrets(p.config)
    key = cache_key(_masked(text, secrets), penv, card, trainer_fingerprint(py), assume)
    cache = home(env) / "cache" / "preflight" / f"{key}.json"
    if use_cache and cache.is_file():
        v = _read_cached(cache)
        if v is not None:
            if not v.status == "refused":
                say(v.line())
            return v
    item = {"id": "config", "yaml": text, "env": penv, "card": card}
    try:
        out, seconds = run_child(
            [item], py, {**env, **p.env}, assume_packages=assume, timeout=timeout, log=_log_path(env)
        )
    except TrainerError as exc:
        v = Verdict("skipped", exc.message)
        say(v.line())
        return v
    v = _redacted(verdict_of(out["results"][0], out.get("llamafactory"), seconds), secrets, env)
    if v.status in ("ok", "refused") and use_cache:
        _write_cached(cache, v, say)
    if v.status != "refused":  # a refusal is said by the error that carries it
        say(v.line())
    return v


def _masked(text: str, secrets: Mapping[str, Any]) -> str:
    """The config text with its secret values (4 characters or more) as ***: what the cache key hashes."""
    masked = text
    for value in secrets.values():
        if len(str(value)) >= 4:
            masked = masked.replace(str(value), "***")
    return masked


def _redacted(v: Verdict, secrets: Mapping[str, Any], env: Mapping[str, str]) -> Verdict:
    """The verdict with the config's secrets and the secret environment variables out of its message."""
    if v.message and secrets:
        v = Verdict(**{**v.__dict__, "message": redact(v.message, {}, [str(s) for s in secrets.values()])})
    if v.message:
        v = Verdict(**{**v.__dict__, "message": redact(v.message, {k: env.get(k, "") for k in SECRET_ENV})})
    return v


def _read_cached(cache: Path) -> Verdict | None:
    """A cached verdict; None for a torn or foreign cache file (check again)."""
    try:
        data = json.loads(cache.read_text())
        fields = {**data["verdict"], "assumed": tuple(data["verdict"].get("assumed") or ())}
        return Verdict(**{**fields, "cached": True, "seconds": 0.0})
    except (OSError, ValueError, TypeError, KeyError):
        return None  # a torn or foreign cache file: check again


def _write_cached(cache: Path, v: Verdict, say: Callable[[str], None]) -> None:
    """Keep the verdict for the same config, env, card and trainer; a failed write is said, not raised."""
    try:
        keep = ("status", "message", "llamafactory", "where", "exception", "assumed")
        fields = {k: getattr(v, k) for k in keep}
        write_json_atomic(cache, {"version": 1, "created": now_iso(), "verdict": fields})
    except OSError as exc:
        say(f"preflight: the verdict could not be cached ({exc})")


def require(v: Verdict) -> None:
    """`train`: a refusal stops here, before anything is created (exit 3)."""
    if v.status == "refused":
        raise refusal_error(v)
