"""Classifying a trainer's exit and deciding what to do next. Pure: text and numbers in, data out.

Kinds are kept apart (STYLE rule 3/4): a config error is deterministic and never retried; a CUDA
OOM shrinks the micro-batch (global batch kept) and resumes; a crash retries a bounded number of
times; a run stopped by the user stays stopped.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from typing import Any

from .runstore import FailureKind

# Torchrun prefixes child lines with "[rank0]:"; we search the whole attempt's log.
_CUDA_OOM = re.compile(
    r"(torch\.OutOfMemoryError|torch\.cuda\.OutOfMemoryError|CUDA out of memory|"
    r"CUBLAS_STATUS_ALLOC_FAILED|NCCL[^\n]*out of memory|HIP out of memory)",
)
_EVAL_FRAMES = re.compile(r"(evaluation_loop|prediction_step|in evaluate\b|_evaluate\()")
_TRAIN_FRAMES = re.compile(r"(training_step|inner_training_loop)")
# The final exception line of a traceback: "ValueError: ...", "[rank0]: OSError: ...".
_EXC_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception)): (.*)$", re.M)
# Wrappers that only say "the child failed": look past them to the child's own error.
_WRAPPERS = ("CalledProcessError", "ChildFailedError")
# Deterministic failures: re-running the same config gives the same error.
_CONFIG_TYPES = (
    "FileNotFoundError",
    "HFValidationError",
    "RepositoryNotFoundError",
    "GatedRepoError",
    "EntryNotFoundError",
    "RevisionNotFoundError",
    "IsADirectoryError",
    "NotADirectoryError",
)
_CONFIG_MESSAGES = re.compile(
    r"(not used by the HfArgumentParser|FORCE_TORCHRUN|doesn't support bf16|does not support pure_bf16|"
    r"Cannot open|Undefined dataset|Can't find a valid checkpoint|is not empty|Please |not supported|"
    r"does not exist|No such file|Unknown|invalid|must be|should be|only supports|requires)",
    re.I,
)


@dataclass(frozen=True)
class Exit:
    kind: FailureKind | None  # None: success
    message: str
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def succeeded(self) -> bool:
        return self.kind is None


def _last_match(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    last = None
    for m in pattern.finditer(text):
        last = m
    return last


def _line_of(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    line = text[start : end if end != -1 else len(text)].strip()
    return re.sub(r"^\[rank\d+\]:\s*", "", line)[:400]


def classify(returncode: int, log: str, *, stop_requested: bool = False) -> Exit:
    """What ended the attempt, from its exit code and its whole log."""
    if stop_requested:
        return Exit(FailureKind.STOPPED, "stopped by the user")
    oom = _last_match(_CUDA_OOM, log)
    if returncode == 0 and oom is None:
        return Exit(None, "training finished")
    if oom is not None:
        # Which loop ran out: the frames printed just before the error name it.
        before = log[max(0, oom.start() - 8000) : oom.start()]
        ev, tr = _last_match(_EVAL_FRAMES, before), _last_match(_TRAIN_FRAMES, before)
        in_eval = ev is not None and (tr is None or ev.start() > tr.start())
        kind = FailureKind.EVAL_OOM if in_eval else FailureKind.CUDA_OOM
        return Exit(kind, _line_of(log, oom.start()))
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL) and "Traceback" not in log[-20000:]:
        return Exit(
            FailureKind.HOST_OOM,
            f"killed by signal 9 (exit {returncode}) with no traceback: most likely the host's "
            "OOM killer (check `dmesg` / journalctl -k)",
        )
    errors = [m for m in _EXC_LINE.finditer(log) if not m.group(1).endswith(_WRAPPERS)]
    if errors:
        last = errors[-1]
        etype, msg = last.group(1).rsplit(".", 1)[-1], last.group(2)
        if etype in _CONFIG_TYPES or (etype in ("ValueError", "OSError") and _CONFIG_MESSAGES.search(msg)):
            return Exit(FailureKind.CONFIG, _line_of(log, last.start()), {"exception": etype})
        return Exit(FailureKind.CRASH, f"exit code {returncode}: {_line_of(log, last.start())}", {"exception": etype})
    tail = [ln for ln in log.strip().splitlines() if ln.strip()][-1:] or [""]
    return Exit(FailureKind.CRASH, f"exit code {returncode}: {tail[0].strip()[:300]}")


# ---------------------------------------------------------------- what to do next

ZERO3_OFFLOAD = "ds_z3_offload"  # placeholder value, mapped to ftlaunch/data/ds_z3_offload_config.json


@dataclass(frozen=True)
class Budget:
    """Retries left. OOM steps refill when a new checkpoint lands; crashes do not."""

    oom_max: int = 4
    crash_max: int = 2
    oom_used: int = 0
    crash_used: int = 0

    def to_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("oom_max", "crash_max", "oom_used", "crash_used")}


@dataclass(frozen=True)
class Decision:
    action: str  # "succeed" | "retry" | "fail" | "stop"
    message: str
    edits: dict[str, Any] = field(default_factory=dict)  # config changes for the next attempt
    budget: Budget = Budget()


def _smaller_divisor(total: int, current: int) -> int | None:
    """Halve, or the next divisor of total below current/2 (global batch kept exactly)."""
    for d in range(max(1, current // 2), 0, -1):
        if total % d == 0 and d < current:
            return d
    return None


def oom_step(config: dict[str, Any], offload_ok: bool) -> tuple[dict[str, Any], str] | None:
    """The next memory-saving step after a CUDA OOM, or None when nothing is left."""
    micro = int(config.get("per_device_train_batch_size", 8) or 8)
    accum = int(config.get("gradient_accumulation_steps", 1) or 1)
    total = micro * accum
    smaller = _smaller_divisor(total, micro)
    if smaller is not None:
        return (
            {"per_device_train_batch_size": smaller, "gradient_accumulation_steps": total // smaller},
            f"micro-batch {smaller} x accumulation {total // smaller}",
        )
    if config.get("disable_gradient_checkpointing"):
        return {"disable_gradient_checkpointing": False}, "gradient checkpointing on"
    if offload_ok and not config.get("deepspeed"):
        return {"deepspeed": ZERO3_OFFLOAD}, "ZeRO-3 with CPU offload on one GPU"
    return None


def decide(
    ex: Exit,
    config: dict[str, Any],
    budget: Budget,
    *,
    recover: bool = True,
    progressed: bool = False,
    offload_ok: bool = False,
    step: int | None = None,
    resume_from: str | None = None,
) -> Decision:
    """Decide after an attempt ended. ``progressed``: a new checkpoint landed during it."""
    if ex.kind is None:
        return Decision("succeed", "training finished", budget=budget)
    if ex.kind is FailureKind.STOPPED:
        return Decision("stop", "stopped by the user; resume with `ftlaunch resume`", budget=budget)
    if ex.kind in (FailureKind.CONFIG, FailureKind.SETUP):
        return Decision("fail", f"{ex.message} (a config error: not retried)", budget=budget)
    if not recover:
        return Decision("fail", f"{ex.message} (recovery off)", budget=budget)
    where = f" at step {step}" if step is not None else ""
    origin = f"from {resume_from}" if resume_from else "from the start (no complete checkpoint yet)"
    if ex.kind in (FailureKind.CUDA_OOM, FailureKind.EVAL_OOM):
        if progressed:
            budget = Budget(budget.oom_max, budget.crash_max, 0, budget.crash_used)
        n = budget.oom_used + 1
        if n > budget.oom_max:
            return Decision("fail", f"out of memory {budget.oom_max} times without progress: giving up", budget=budget)
        if ex.kind is FailureKind.EVAL_OOM:
            ev = int(config.get("per_device_eval_batch_size", 8) or 8)
            if ev <= 1:
                return Decision("fail", "OOM during evaluation at eval batch 1: giving up", budget=budget)
            edits, what = {"per_device_eval_batch_size": max(1, ev // 2)}, f"eval batch {max(1, ev // 2)}"
        else:
            step_ = oom_step(config, offload_ok)
            if step_ is None:
                return Decision(
                    "fail",
                    "out of memory at micro-batch 1 with gradient checkpointing on and no offload "
                    "left: this config does not fit; try LoRA/QLoRA, a shorter cutoff_len or more GPUs "
                    "(`ftlaunch plan` shows what fits)",
                    budget=budget,
                )
            edits, what = step_
        micro = config.get("per_device_train_batch_size")
        label = "OOM in evaluation" if ex.kind is FailureKind.EVAL_OOM else "OOM"
        msg = f"[{n}/{budget.oom_max}] {label}{where} (micro-batch {micro}): retrying with {what} {origin}"
        return Decision("retry", msg, edits, Budget(budget.oom_max, budget.crash_max, n, budget.crash_used))
    n = budget.crash_used + 1
    if n > budget.crash_max:
        return Decision("fail", f"{ex.message}: crashed {budget.crash_max + 1} times, giving up", budget=budget)
    label = "host OOM" if ex.kind is FailureKind.HOST_OOM else "crash"
    msg = f"[{n}/{budget.crash_max}] {label}{where} ({ex.message}): retrying with the same config {origin}"
    return Decision("retry", msg, {}, Budget(budget.oom_max, budget.crash_max, budget.oom_used, n))
