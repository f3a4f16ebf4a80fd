"""The estimate's two shells: child processes that run llamafactory for ftlaunch.estimate.core.

- ``count_tokens``: runs llamafactory's own preprocessing (``get_train_args`` -> ``load_tokenizer``
  -> ``get_template_and_fix_tokenizer`` -> ``get_dataset``, the calls ``run_sft`` makes) in a child
  Python and reads per-sequence lengths back as JSON, as a ftlaunch.estimate.padding.TokenStats;
- ``probe_throughput``: a short real ``llamafactory-cli train`` in a scratch output_dir, measured
  as a ftlaunch.estimate.throughput.Throughput.

What they decide (``counting_config``, ``probe_config``, ``child_env``) are plain functions over
data. ftlaunch never imports torch, transformers, datasets or llamafactory in its own process: the
child does. Method: docs/estimate.md, sections 1 and 4.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ftlaunch.estimate.padding import (
    DEFAULT_CUTOFF_LEN,
    IGNORE_INDEX,
    RAW_CUTOFF,
    TokenStats,
    token_stats_from_child,
)
from ftlaunch.estimate.throughput import Throughput, throughput_from_probe

# ============================================================================================
# Shell 1: count tokens with llamafactory's own preprocessing, in a child process
# ============================================================================================

# Keys that depend on the machine, not the data: llamafactory's argument checks would fail on a
# machine without the card the plan is for (bf16 on a CPU), or need packages irrelevant to counting.
_MACHINE_KEYS = (
    "deepspeed",
    "fsdp",
    "fsdp_config",
    "quantization_bit",
    "quantization_method",
    "quantization_type",
    "double_quantization",
    "use_unsloth",
    "use_unsloth_gc",
    "enable_liger_kernel",
    "use_kt",
    "resume_from_checkpoint",
    "logging_dir",
    "run_name",
)


# Must match count_child.EMPTY_TOKENIZER (the child is run by path and imports nothing of ftlaunch).
EMPTY_TOKENIZER = "FTLAUNCH_EMPTY_TOKENIZER:"
TOKENIZER_HINT = (
    "copy the tokenizer files of the base model (tokenizer.json, tokenizer_config.json, ...) into the model "
    "folder, or point model_name_or_path at a folder or hub id that has them"
)
# A folder needs one of these (or a *.tiktoken file) to hold a vocabulary: the files transformers'
# tokenizers load a vocabulary from. tokenizer_config.json / special_tokens_map.json alone hold none.
VOCAB_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.model",
    "qwen.tiktoken",
)


def tokenizer_problem(model: Any) -> str | None:
    """What is missing when ``model`` is a local model folder with no tokenizer vocabulary, else None
    (a hub id, or a folder the child will load). transformers 5 does not fail on such a folder: it
    builds an empty tokenizer that encodes every text to nothing."""
    if not isinstance(model, str) or not model:
        return None
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return None
    names = {p.name for p in folder.iterdir()}
    if names & set(VOCAB_FILES) or any(n.endswith(".tiktoken") for n in names):
        return None
    return (
        f"model_name_or_path: {folder} has no tokenizer files (none of {', '.join(VOCAB_FILES)} or *.tiktoken): "
        "transformers would build an empty tokenizer that encodes every text to nothing, so no token count "
        "can be made"
    )


def counting_config(values: Mapping[str, Any], scratch: Path) -> dict[str, Any]:
    """The config the counting child parses: the data-relevant keys as the trainer sees them."""
    cfg = {k: v for k, v in values.items() if k not in _MACHINE_KEYS}
    for key in ("bf16", "fp16", "pure_bf16", "push_to_hub", "load_best_model_at_end"):
        if key in cfg:
            cfg[key] = False
    cfg.update(
        {
            "output_dir": str(scratch / "output"),
            "overwrite_output_dir": True,
            "report_to": "none",
            "do_train": True,
        }
    )
    tp = cfg.get("tokenized_path")
    if tp and not Path(str(tp)).is_dir():
        del cfg["tokenized_path"]  # it would save there; only a saved one is read
    return cfg


def trainer_python(env: Mapping[str, str]) -> str:
    """The Python llamafactory-cli runs under (its shebang), so the child imports the same
    llamafactory the trainer will; else this Python."""
    import sys

    from ftlaunch.errors import TrainerError
    from ftlaunch.run.trainer import find_trainer

    try:
        exe = find_trainer(env)[0]
        first = Path(exe).read_bytes()[:256].split(b"\n", 1)[0].decode(errors="replace")
    except (TrainerError, OSError):
        return sys.executable
    if first.startswith("#!"):
        interp = first[2:].strip().split()[0] if first[2:].strip() else ""
        if "python" in Path(interp).name and Path(interp).is_file():
            return interp
    return sys.executable


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """The counting child's environment: the caller's, without a GPU (tokenizing needs none and
    must not take one from a run) and without torchrun."""
    out = {k: v for k, v in env.items() if k not in ("FORCE_TORCHRUN", "NPROC_PER_NODE")}
    out["CUDA_VISIBLE_DEVICES"] = ""
    out.setdefault("PYTHONUNBUFFERED", "1")
    return out


def _last_error(log: str) -> str:
    lines = [x.strip() for x in log.splitlines() if x.strip()]
    for line in reversed(lines):
        if ("Error" in line or "Exception" in line) and ":" in line and not line.startswith("File "):
            return line
    return lines[-1] if lines else "no output"


def count_tokens(
    config_values: Mapping[str, Any],
    env: Mapping[str, str],
    workdir: str | Path,
    *,
    python: str | None = None,
    timeout: float | None = None,
) -> TokenStats:
    """Run llamafactory's preprocessing on ``config_values`` (the adapted config) in a child
    process under ``workdir`` and return its exact token counts."""
    from ftlaunch.errors import ConfigError, TrainerError

    if problem := tokenizer_problem(config_values.get("model_name_or_path")):
        raise ConfigError(problem, hint=TOKENIZER_HINT)
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    spec = {"config": counting_config(config_values, work), "raw_cutoff": RAW_CUTOFF, "ignore_index": IGNORE_INDEX}
    spec_path, out_path, log_path = work / "count_spec.json", work / "count_out.json", work / "count.log"
    spec_path.write_text(json.dumps(spec, default=str))
    # Run by path, not `-m`: the trainer's Python (which must import llamafactory) may not have ftlaunch.
    script = Path(__file__).with_name("count_child.py")
    out_path.unlink(missing_ok=True)
    cmd = [python or trainer_python(env), str(script), str(spec_path), str(out_path)]
    try:
        with open(log_path, "wb") as log:
            rc = subprocess.run(
                cmd, env=child_env(env), stdout=log, stderr=subprocess.STDOUT, cwd=work, timeout=timeout
            ).returncode
    except subprocess.TimeoutExpired:
        raise TrainerError(f"counting tokens took longer than {timeout:.0f} s", hint=f"its log: {log_path}") from None
    except OSError as exc:
        raise TrainerError(f"cannot run {cmd[0]}: {exc}", hint="install the train extra") from None
    text = log_path.read_text(errors="replace")
    if rc != 0 or not out_path.is_file():
        empty = [line for line in text.splitlines() if line.startswith(EMPTY_TOKENIZER)]
        if empty:
            raise ConfigError(
                f"model_name_or_path: {empty[-1][len(EMPTY_TOKENIZER) :].strip()}; no token count can be made",
                hint=TOKENIZER_HINT,
            )
        err = _last_error(text)
        if "No module named 'llamafactory'" in text:
            raise TrainerError(f"llamafactory is not importable by {cmd[0]}", hint="pip install 'ftlaunch[train]'")
        raise ConfigError(f"llamafactory's preprocessing failed: {err}", hint=f"its full log: {log_path}")
    data = json.loads(out_path.read_text())
    cutoff = int(config_values.get("cutoff_len") or DEFAULT_CUTOFF_LEN)
    return token_stats_from_child(data, cutoff)


# ============================================================================================
# Shell 2: probe throughput with a short real run
# ============================================================================================


def probe_config(values: Mapping[str, Any], output_dir: Path, steps: int, warmup: int) -> dict[str, Any]:
    """The probe's config: the real one, but a scratch output_dir, warmup + steps optimizer steps,
    every step logged with tokens counted, and no saving, evaluation or reporting."""
    cfg = {k: v for k, v in values.items() if k not in ("resume_from_checkpoint", "logging_dir", "run_name")}
    cfg.update(
        {
            "output_dir": str(output_dir),
            "overwrite_output_dir": True,
            "max_steps": int(warmup + steps),
            "logging_steps": 1,
            "save_strategy": "no",
            "eval_strategy": "no",
            "do_eval": False,
            "do_predict": False,
            "load_best_model_at_end": False,
            "report_to": "none",
            "plot_loss": False,
            "push_to_hub": False,
            "include_num_input_tokens_seen": "non_padding",
        }
    )
    tp = cfg.get("tokenized_path")
    if tp and not Path(str(tp)).is_dir():
        del cfg["tokenized_path"]
    return cfg


def probe_throughput(
    config_values: Mapping[str, Any],
    env: Mapping[str, str],
    steps: int = 20,
    warmup: int = 5,
    *,
    plan_env: Mapping[str, str] | None = None,
    workdir: str | Path | None = None,
    timeout: float | None = None,
    poll: float = 0.02,
    clock: Callable[[], float] = time.monotonic,
    keep: bool = False,
) -> Throughput:
    """Run ``llamafactory-cli train`` for warmup + steps optimizer steps in a scratch output_dir
    (deleted afterwards unless it failed or ``keep``) and measure the sustained rate."""
    from ftlaunch.errors import FtlaunchError
    from ftlaunch.files import home
    from ftlaunch.plan.config import dump_yaml
    from ftlaunch.run.procs import terminate_group
    from ftlaunch.run.progress import parse_trainer_log
    from ftlaunch.run.tail import Tail
    from ftlaunch.run.trainer import find_trainer, trainer_env

    if steps < 2:
        raise ValueError("probe steps must be >= 2")
    base = Path(workdir) if workdir else home(env) / "scratch"
    base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="probe-", dir=base))
    out_dir = scratch / "output"
    cfg_path = scratch / "probe.yaml"
    cfg_path.write_text(dump_yaml(probe_config(config_values, out_dir, steps, warmup)))
    log_path = scratch / "probe.log"
    cmd = [*find_trainer(env), "train", str(cfg_path)]
    tlog = out_dir / "trainer_log.jsonl"
    observed: dict[int, float] = {}
    t0 = clock()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            env=trainer_env(env, plan_env or {}),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=scratch,
            start_new_session=True,
        )
    tail = Tail(tlog)
    try:
        while True:
            rc = proc.poll()
            if tlog.exists():
                new = tail.records()
                now = clock() - t0
                for rec in new:
                    if rec.get("loss") is not None:
                        observed.setdefault(int(rec["current_steps"]), now)
            if rc is not None:
                break
            if timeout is not None and clock() - t0 > timeout:
                terminate_group(proc.pid, grace=10)
                raise FtlaunchError(
                    f"the probe did not finish within {timeout:.0f} s", hint=f"its log and config: {scratch}"
                )
            time.sleep(poll)
    except BaseException:
        if proc.poll() is None:
            terminate_group(proc.pid, grace=10)
        raise
    wall = clock() - t0
    records = parse_trainer_log(tlog.read_text(errors="replace")) if tlog.exists() else []  # torn bytes: skipped
    if rc != 0 or len([r for r in records if r.get("loss") is not None]) < 2:
        text = log_path.read_text(errors="replace")
        raise FtlaunchError(
            f"the probe run failed (exit {rc}): {_last_error(text)}",
            hint=f"its log and config: {scratch}; `ftlaunch plan` shows what the config needs",
        )
    result = throughput_from_probe(records, observed, wall, warmup)
    if not keep:
        shutil.rmtree(scratch, ignore_errors=True)
    return result
