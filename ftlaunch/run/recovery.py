"""Classifying a trainer's exit and deciding what to do next. Pure: text and numbers in, data out.

Kinds are kept apart (STYLE rule 3/4): a config error is deterministic and never retried; a CUDA
OOM shrinks the micro-batch (global batch kept) and resumes; a crash retries a bounded number of
times; a run stopped by the user stays stopped.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from ftlaunch.plan.batch import divisors_desc
from ftlaunch.plan.change import Change
from ftlaunch.plan.offload import ZERO3_OFFLOAD
from ftlaunch.run.policy import Budget
from ftlaunch.run.state import FailureKind, RunStatus

# The restart brake (issue 20; NVIDIA's launcher stops after 3 restart cycles whose checkpoint did not
# advance): attempts in a row that end in a failure retried with the same config (POLICIES' braked
# rows) and save no new checkpoint. Larger crash or stall budgets the user asked for are honoured.
NO_PROGRESS_LIMIT = 3

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
# A package the config needs is not installed where the trainer runs (use_unsloth without unsloth,
# deepspeed, bitsandbytes; LLaMA-Factory's check_version raises PackageNotFoundError): the same every
# time, a setup error, never retried (issue 40).
_MISSING_TYPES = ("ModuleNotFoundError", "ImportError", "PackageNotFoundError")
_MISSING_MESSAGES = re.compile(
    r"(No module named|is not installed|Please install|pip install|was not found and is required)"
)
# Python's own words when `python -m MODULE` cannot import its package (no traceback follows).
_NO_MODULE = re.compile(r"(Error while finding module specification|No module named)[^\n]*")
_CONFIG_MESSAGES = re.compile(
    r"(not used by the HfArgumentParser|FORCE_TORCHRUN|doesn't support bf16|does not support pure_bf16|"
    r"Cannot open|Undefined dataset|Can't find a valid checkpoint|is not empty|Please |not supported|"
    r"does not exist|No such file|Unknown|invalid|must be|should be|only supports|requires)",
    re.I,
)


# A checkpoint the trainer could not load on resume (issue 40): torch's zip reader, a safetensors
# header, a pickle cut short. Only inside the Trainer's resume frames: the same errors while loading
# the base model are the model's, and no checkpoint of the run is to blame.
_LOAD_ERROR = re.compile(
    r"(PytorchStreamReader failed|failed finding central directory|Error while deserializing header|"
    r"unexpected EOF|Ran out of input|pickle data was truncated|invalid load key|archive is corrupted)"
)
_RESUME_FRAMES = re.compile(
    r"in (_load_from_checkpoint|_load_optimizer_and_scheduler|_load_rng_state|_load_scaler|"
    r"deepspeed_load_checkpoint|load_checkpoint)\b"
)
# Exit.detail's key, with the error line: the attempt failed to load the checkpoint it resumed from (the
# supervisor sets it aside, ftlaunch.run.ending.after_unloadable, and the next attempt resumes from the one before).
UNLOADABLE = "unloadable_checkpoint"

# The line ftlaunch.run.slurm.rendezvous prints when the nodes did not reach each other in time.
_RENDEZVOUS = re.compile(r"ftlaunch: rendezvous failed:[^\n]*")


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


def _success(returncode: int, log: str) -> Exit | None:
    if returncode == 0 and _last_match(_CUDA_OOM, log) is None:  # an OOM a wrapper survived is no success
        return Exit(None, "training finished")
    return None


def _rendezvous(returncode: int, log: str) -> Exit | None:
    # ftlaunch.run.slurm.rendezvous: a retry meets the same nodes and the same network
    found = _RENDEZVOUS.search(log)
    return Exit(FailureKind.RENDEZVOUS, found.group(0).strip()) if found else None


def _cuda_oom(returncode: int, log: str) -> Exit | None:
    oom = _last_match(_CUDA_OOM, log)
    if oom is None:
        return None
    # Which loop ran out: the frames printed just before the error name it.
    before = log[max(0, oom.start() - 8000) : oom.start()]
    ev, tr = _last_match(_EVAL_FRAMES, before), _last_match(_TRAIN_FRAMES, before)
    in_eval = ev is not None and (tr is None or ev.start() > tr.start())
    kind = FailureKind.EVAL_OOM if in_eval else FailureKind.CUDA_OOM
    return Exit(kind, _line_of(log, oom.start()), oom_numbers(log[oom.start() : oom.start() + 2000]))


def _bare_sigkill(returncode: int, log: str) -> Exit | None:
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL) and "Traceback" not in log[-20000:]:
        # What sent the SIGKILL is not known from here; the supervisor asks the kernel log.
        return Exit(FailureKind.HOST_OOM, f"killed by signal 9 (exit {returncode}) with no traceback")
    return None


def _unloadable_checkpoint(returncode: int, log: str) -> Exit | None:
    """A load error inside the resume's frames: the checkpoint is unreadable, not the config. A crash
    (retried, braked, from the checkpoint before once this one is set aside), never a config error."""
    found = _last_match(_LOAD_ERROR, log)
    if returncode == 0 or found is None or not _RESUME_FRAMES.search(log[max(0, found.start() - 8000) : found.start()]):
        return None
    line = _line_of(log, found.start())
    etype = m.group(1).rsplit(".", 1)[-1] if (m := _EXC_LINE.match(line)) else "LoadError"
    message = f"exit code {returncode}: the checkpoint it resumed from does not load: {line}"
    return Exit(FailureKind.CRASH, message, {"exception": etype, UNLOADABLE: line})


def _final_exception(log: str) -> tuple[re.Match[str], str] | None:
    """The traceback's last exception line (past wrappers that only say a child failed) and its type."""
    errors = [m for m in _EXC_LINE.finditer(log) if not m.group(1).endswith(_WRAPPERS)]
    return (errors[-1], errors[-1].group(1).rsplit(".", 1)[-1]) if errors else None


def _missing_package(returncode: int, log: str) -> Exit | None:
    """An attempt that died for want of a package: its last exception is an import error or says to
    install one; with no traceback, Python's own "No module named" line (``python -m`` of a package it
    cannot import)."""
    found = _final_exception(log)
    if found is not None:
        last, etype = found
        if etype not in _MISSING_TYPES and not _MISSING_MESSAGES.search(last.group(2)):
            return None
        line = _line_of(log, last.start())
    else:
        tail = [ln for ln in log.strip().splitlines() if ln.strip()][-1:]
        bare = _NO_MODULE.search(tail[0]) if tail else None
        if bare is None:
            return None
        line, etype = bare.group(0).strip()[:400], "ModuleNotFoundError"
    return Exit(FailureKind.SETUP, f"a package is missing where the trainer runs: {line}", {"exception": etype})


def _exception(returncode: int, log: str) -> Exit | None:
    found = _final_exception(log)
    if found is None:
        return None
    last, etype = found
    msg = last.group(2)
    if etype in _CONFIG_TYPES or (etype in ("ValueError", "OSError") and _CONFIG_MESSAGES.search(msg)):
        return Exit(FailureKind.CONFIG, _line_of(log, last.start()), {"exception": etype})
    return Exit(FailureKind.CRASH, f"exit code {returncode}: {_line_of(log, last.start())}", {"exception": etype})


def driver_error(logs: str) -> Exit | None:
    """What the last output of a job's driver that died before recording an end says (Ray keeps it in
    the job's message): a missing package, else a traceback's last exception (a config error or a
    crash), its line as the message; None when it shows neither (a kill -9 mid-run)."""
    missing = _missing_package(0, logs)
    if missing is not None:
        return missing
    found, ex = _final_exception(logs), _exception(0, logs)
    return Exit(ex.kind, _line_of(logs, found[0].start()), ex.detail) if found and ex else None


def _last_line(returncode: int, log: str) -> Exit:
    tail = [ln for ln in log.strip().splitlines() if ln.strip()][-1:]
    said = tail[0].strip()[:300] if tail else "(it printed nothing)"
    return Exit(FailureKind.CRASH, f"exit code {returncode}: {said}")


# The classification table: the first row that matches an attempt's (exit code, whole log) names what
# ended it. Order matters: a success is one with no OOM anywhere; an OOM is told before a bare SIGKILL
# (the kernel may kill a trainer that already printed one); a checkpoint that does not load on resume
# before the other exceptions (it may end in an OSError a config error would match); a traceback's last
# exception before the last line. A new failure class adds one row here (most are a regex: a search of the log).
PATTERNS: tuple[Callable[[int, str], Exit | None], ...] = (
    _success,
    _rendezvous,
    _cuda_oom,
    _bare_sigkill,
    _unloadable_checkpoint,
    _missing_package,
    _exception,
    _last_line,
)


# A stop a Slurm batch step asked for (SIGUSR2, ftlaunch.run.slurm.job), as journaled: the batch step
# then records which it was (requeued, or ended by Slurm).
SLURM_STOP = "stopped for Slurm (time limit, requeue, preemption or an outside scancel), not by the user"


def for_slurm(ex: Exit, signum: int | None) -> Exit:
    """A stop asked for with SIGUSR2 is Slurm's (the batch step's), never the user's."""
    return Exit(FailureKind.STOPPED, SLURM_STOP) if ex.kind is FailureKind.STOPPED and signum == signal.SIGUSR2 else ex


def classify(returncode: int, log: str, *, stop_requested: bool = False) -> Exit:
    """What ended the attempt, from its exit code and its whole log: the first row of PATTERNS that matches."""
    if stop_requested:
        return Exit(FailureKind.STOPPED, "stopped by the user")
    return next(ex for row in PATTERNS if (ex := row(returncode, log)) is not None)


def without_steps(ex: Exit, stepped: bool) -> Exit:
    """A trainer that exits 0 having run no optimizer step in any attempt and saved no checkpoint did
    not train: an empty dataset after max_samples/cutoff, do_train off, a predict-only config. It is a
    config error (the same every time), never `succeeded`."""
    if ex.kind is not None or stepped:
        return ex
    return Exit(
        FailureKind.CONFIG,
        "the trainer exited 0 without a single optimizer step: nothing was trained (is the dataset empty "
        "after max_samples and cutoff_len, or do_train off?)",
        {"exception": "NoSteps"},
    )


# ---------------------------------------------------------------- how an attempt ended


@dataclass(frozen=True)
class Halt:
    """A watch's word to stop the trainer now (ftlaunch.run.watch), and what the attempt then ends as."""

    kind: FailureKind
    message: str


@dataclass(frozen=True)
class AttemptEnd:
    """One attempt, ended: the trainer's exit code and train.log text, the last step it logged,
    whether a checkpoint beyond any earlier one landed, and the halts the watches called (in order)."""

    rc: int
    log_text: str
    last_step: int | None = None
    progressed: bool = False
    halts: tuple[Halt, ...] = ()

    def halted(self, kind: FailureKind) -> str | None:
        """The message of the first halt of ``kind``, else None."""
        return next((h.message for h in self.halts if h.kind is kind), None)


def why_it_ended(
    end: AttemptEnd, *, stopped: bool, stepped: Callable[[], bool], enospc: Callable[[str], str | None]
) -> Exit:
    """What ended the attempt: a stall or the disk check (ours), else the trainer's exit and log, with a
    zero-step success and an ENOSPC told apart. ``stepped``: whether any attempt ran a step or saved a
    checkpoint (asked only when it matters); ``enospc``: the log's write-failed-for-space line, if any."""
    stalled, disk_full = end.halted(FailureKind.STALLED), end.halted(FailureKind.DISK_FULL)
    if stalled is not None and not stopped:
        return Exit(FailureKind.STALLED, stalled)
    if disk_full is not None and not stopped:
        return Exit(FailureKind.DISK_FULL, disk_full)
    ex = classify(end.rc, end.log_text, stop_requested=stopped)
    if ex.succeeded:
        ex = without_steps(ex, end.last_step is not None or stepped())
    if ex.kind in (FailureKind.CRASH, FailureKind.CONFIG) and (line := enospc(end.log_text)) is not None:
        return Exit(FailureKind.DISK_FULL, f"a save ran out of space: {line}")
    return ex


# ---------------------------------------------------------------- what to do next


_GIB = {"B": 2**-30, "KiB": 2**-20, "MiB": 2**-10, "GiB": 1.0, "TiB": 1024.0}
_SIZE = r"([\d.]+)\s*(B|KiB|MiB|GiB|TiB)"
_OOM_TRIED = re.compile(rf"Tried to allocate {_SIZE}")
_OOM_TOTAL = re.compile(rf"(?:total capacity of {_SIZE}|{_SIZE} total capacity)")
_OOM_FREE = re.compile(rf"(?:of which {_SIZE} is free|{_SIZE} free)")
_OOM_IN_USE = re.compile(rf"(?:has {_SIZE} memory in use|{_SIZE} already allocated)")


def _gib(m: re.Match[str] | None) -> float | None:
    if m is None:
        return None
    groups = [g for g in m.groups() if g is not None]
    return float(groups[0]) * _GIB[groups[1]]


def oom_numbers(text: str) -> dict[str, float]:
    """torch's OOM message in GiB: ``tried`` (the allocation that failed), ``free``, ``total``.

    Empty when the message lacks them (CUBLAS, NCCL, other runtimes); total is in-use + free when
    only those two are given."""
    tried, free = _gib(_OOM_TRIED.search(text)), _gib(_OOM_FREE.search(text))
    total = _gib(_OOM_TOTAL.search(text))
    in_use = _gib(_OOM_IN_USE.search(text))
    if total is None and in_use is not None and free is not None:
        total = in_use + free
    if tried is None or free is None or not total:
        return {}
    return {"tried_gib": tried, "free_gib": free, "total_gib": total}


class Action(StrEnum):
    """What the supervisor does after an attempt ended."""

    SUCCEED = "succeed"
    RETRY = "retry"
    FAIL = "fail"
    STOP = "stop"


@dataclass(frozen=True)
class Decision:
    action: Action
    message: str
    changes: tuple[Change, ...] = ()  # config changes for the next attempt
    budget: Budget = Budget()
    ends: RunStatus | None = None  # FAIL: the status the run ends with (None: failed)
    no_progress: int = 0  # attempts in a row without a new checkpoint (the restart brake's count)

    @property
    def edits(self) -> dict[str, Any]:
        """The changes as key -> new value (what the next attempt's config gets, what events record)."""
        return {c.key: c.new for c in self.changes}


def signature(config: dict[str, Any]) -> str:
    """What makes one configuration distinct for the OOM budget."""
    return (
        f"mb{config.get('per_device_train_batch_size')}"
        f"/eval{config.get('per_device_eval_batch_size')}"
        f"/gc{'off' if config.get('disable_gradient_checkpointing') else 'on'}"
        f"/ds{config.get('deepspeed') or '-'}"
    )


def _micro_edit(micro: int, total: int) -> tuple[dict[str, Any], str]:
    return (
        {"per_device_train_batch_size": micro, "gradient_accumulation_steps": total // micro},
        f"micro-batch {micro} x accumulation {total // micro}",
    )


def _bottom_rungs(config: dict[str, Any], offload_ok: bool) -> list[tuple[dict[str, Any], str]]:
    """What is always tried after micro-batch 1, in order, before giving up."""
    rungs: list[tuple[dict[str, Any], str]] = []
    if config.get("disable_gradient_checkpointing"):
        rungs.append(({"disable_gradient_checkpointing": False}, "gradient checkpointing on"))
    if offload_ok and not config.get("deepspeed"):
        rungs.append(({"deepspeed": ZERO3_OFFLOAD}, "ZeRO-3 with CPU offload on one GPU"))
    return rungs


def oom_step(
    config: dict[str, Any],
    offload_ok: bool,
    *,
    retries_left: int | None = None,
    numbers: dict[str, float] | None = None,
    headroom: float = 0.1,
) -> tuple[dict[str, Any], str] | None:
    """The next memory-saving step after a CUDA OOM, or None when the ladder is exhausted.

    The ladder always reaches micro-batch 1, then gradient checkpointing, then offload. Between the
    current micro-batch and 1 it spaces its tries so that ``retries_left`` reach the bottom (halving
    at least), and the OOM message's numbers jump further: with peak(m) = fixed + m x per-sample and
    fixed >= 0, a micro-batch above m x usable / (in use + tried) cannot fit, where usable keeps
    ``headroom`` of the card free (the safety margin), so the step goes at least below that bound."""
    micro = int(config.get("per_device_train_batch_size") or 1)
    accum = int(config.get("gradient_accumulation_steps") or 1)
    total = micro * accum
    below = [d for d in divisors_desc(total) if d < micro]  # micro-batches that keep it exact
    if not below:
        rungs = _bottom_rungs(config, offload_ok)
        return rungs[0] if rungs else None
    bottom = 1 + len(_bottom_rungs(config, offload_ok))  # micro-batch 1, then the rest
    explore = None if retries_left is None else retries_left - bottom
    if explore is not None and explore <= 0:
        return _micro_edit(1, total)
    ratio = 2.0 if explore is None else max(2.0, micro ** (1.0 / (explore + 1)))
    target = micro / ratio
    if numbers:
        usable = numbers["total_gib"] * (1 - headroom)
        needed = numbers["total_gib"] - numbers["free_gib"] + numbers["tried_gib"]
        bound = micro * usable / needed if needed > 0 else target
        target = min(target, bound)
    choice = next((d for d in below if d <= target), 1)
    return _micro_edit(choice, total)


def is_v1(config: dict[str, Any]) -> bool:
    """A config of LLaMA-Factory's v1 trainer (USE_V1): its batch keys are micro_batch_size and
    global_batch_size, and it knows none of the v0 keys the ladder edits."""
    return "micro_batch_size" in config and "per_device_train_batch_size" not in config


def _v1_oom_step(config: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """v1: a smaller micro_batch_size (v1 derives the accumulation from global_batch_size, which stays)."""
    micro = int(config.get("micro_batch_size") or 1)
    total = int(config.get("global_batch_size") or micro)
    below = [d for d in divisors_desc(total) if d < micro] or ([micro // 2] if micro > 1 else [])
    if not below:
        return None
    choice = next((d for d in below if d <= micro / 2), below[-1])
    return {"micro_batch_size": choice}, f"micro_batch_size {choice} (global_batch_size {total} kept)"


def next_to_try(config: dict[str, Any], offload_ok: bool) -> str:
    """What a person could try after the ladder gave up (the give-up message says it)."""
    ideas = ["LoRA or QLoRA (finetuning_type: lora, quantization_bit: 4)", "a shorter cutoff_len", "more GPUs"]
    if not offload_ok and not config.get("deepspeed"):
        ideas.insert(0, "DeepSpeed ZeRO-3 CPU offload (pip install deepspeed)")
    return "; next try " + ", ".join(ideas) + " (`ftlaunch plan CONFIG --gpu CARD` shows what fits)"


class Retry(StrEnum):
    """How a failure class is retried."""

    NEVER = "never"  # the same config fails the same way (a config error, a full disk, the network)
    SHRINK = "shrink"  # the OOM ladder: a smaller micro-batch (global batch kept), then offload
    SAME = "same"  # the same config again, from the last complete checkpoint


@dataclass(frozen=True)
class Policy:
    """One row of the policy table: what a failure class does next.

    ``budget`` names a field of `policy.Retries`: the run's maximum and what it used (the OOM budget
    counts the distinct configs in ``tried``); ``refills``: a new checkpoint empties the count;
    ``braked``: it counts toward the restart brake; ``ends``: the status when not retried or the budget
    is spent (None: failed)."""

    retry: Retry
    budget: str | None = None
    refills: bool = False
    braked: bool = False
    ends: RunStatus | None = None
    label: str = ""  # what the [n/max] line calls it
    verb: str = "retrying"
    note: str = "not retried"  # NEVER: why; SAME: what a spent budget says, with {n} the attempts
    spent: str = ""


_CRASH = Policy(Retry.SAME, "crash", refills=True, braked=True, label="crash", spent="crashed {n} times, giving up")

# The policy table: one row per failure class that recovery decides about.
POLICIES: dict[FailureKind, Policy] = {
    FailureKind.CONFIG: Policy(Retry.NEVER, note="a config error: not retried"),
    FailureKind.SETUP: Policy(
        Retry.NEVER, note="a setup error: not retried; install it where the trainer runs, then `ftlaunch resume`"
    ),
    FailureKind.RENDEZVOUS: Policy(Retry.NEVER),  # a retry meets the same addresses and network
    FailureKind.DISK_FULL: Policy(Retry.NEVER, ends=RunStatus.DISK_FULL),  # the same save, the same full disk
    FailureKind.CUDA_OOM: Policy(Retry.SHRINK, "oom", refills=True, label="OOM"),
    FailureKind.EVAL_OOM: Policy(Retry.SHRINK, "oom", refills=True, label="OOM in evaluation"),
    FailureKind.STALLED: Policy(
        Retry.SAME,
        "stall",
        refills=True,
        braked=True,
        ends=RunStatus.STALLED,
        label="stalled",
        verb="restarting",
        spent="stalled {n} times, giving up (the stacks are in the run folder)",
    ),
    FailureKind.HOST_OOM: replace(_CRASH, label="host OOM"),
    FailureKind.CRASH: _CRASH,
}


_UNLISTED = replace(_CRASH, braked=False)


def policy_of(kind: FailureKind | None) -> Policy:
    """A class's row; one the table does not list (and a success or a stop) is an unbraked crash."""
    return POLICIES.get(kind, _UNLISTED) if kind is not None else _UNLISTED


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
    no_progress: int = 0,
) -> Decision:
    """Decide after an attempt ended. ``progressed``: a checkpoint beyond any earlier one landed
    during it: the refilling budgets refill (progress between failures is not a loop).
    ``no_progress``: the brake's count before this attempt (from the run's state)."""
    policy = policy_of(ex.kind)
    at = _Where(step, resume_from)
    d = _decide(ex, policy, config, _refilled(budget, progressed), recover, progressed, offload_ok, at)
    count = 0 if progressed else no_progress + (1 if policy.braked else 0)
    limit = max([NO_PROGRESS_LIMIT] + [budget.most(str(p.budget)) + 1 for p in POLICIES.values() if p.braked])
    # A budget spent that ends in its own status (stalled) is not braked; a retry or a plain failure is.
    braked = d.action is Action.RETRY or (d.action is Action.FAIL and d.ends is None)
    if braked and policy.braked and count >= limit:
        where = f" (last at step {step}: {ex.message})" if step is not None else f" (last: {ex.message})"
        return Decision(
            Action.FAIL,
            f"{count} attempts in a row ended without a new checkpoint{where}: not restarting again "
            "(the restart brake); fix the cause, then `ftlaunch resume`",
            budget=d.budget,
            ends=RunStatus.NO_PROGRESS,
            no_progress=count,
        )
    return replace(d, no_progress=count)


def _refilled(budget: Budget, progressed: bool) -> Budget:
    """On progress, the attempt-counted budgets that refill start again (the OOM ladder's ``tried``
    restarts at its own decision)."""
    if not progressed:
        return budget
    counted = {str(p.budget) for p in POLICIES.values() if p.refills and p.retry is Retry.SAME}
    return replace(budget, used=replace(budget.used, **dict.fromkeys(counted, 0)))


@dataclass(frozen=True)
class _Where:
    step: int | None
    resume_from: str | None

    @property
    def step_text(self) -> str:
        return f" at step {self.step}" if self.step is not None else ""

    @property
    def origin(self) -> str:
        return f"from {self.resume_from}" if self.resume_from else "from the start (no complete checkpoint yet)"


def _decide(
    ex: Exit,
    policy: Policy,
    config: dict[str, Any],
    budget: Budget,
    recover: bool,
    progressed: bool,
    offload_ok: bool,
    at: _Where,
) -> Decision:
    """One end of an attempt, by its row of the policy table (a success and a stop have none)."""
    if ex.kind is None:
        return Decision(Action.SUCCEED, "training finished", budget=budget)
    if ex.kind is FailureKind.STOPPED:
        return Decision(Action.STOP, "stopped by the user; resume with `ftlaunch resume`", budget=budget)
    if policy.retry is Retry.NEVER:
        return Decision(Action.FAIL, f"{ex.message} ({policy.note})", budget=budget, ends=policy.ends)
    if not recover:
        return Decision(Action.FAIL, f"{ex.message} (recovery off)", budget=budget)
    if policy.retry is Retry.SHRINK:
        return _shrink(ex, policy, config, budget, progressed, offload_ok, at)
    name = str(policy.budget)
    n, most = budget.spent(name) + 1, budget.most(name)
    if n > most:
        spent = policy.spent.format(n=most + 1)
        return Decision(Action.FAIL, f"{ex.message}: {spent}", budget=budget, ends=policy.ends)
    msg = f"[{n}/{most}] {policy.label}{at.step_text} ({ex.message}): {policy.verb} with the same config {at.origin}"
    return Decision(Action.RETRY, msg, (), budget.spending(name, n))


def _shrink(
    ex: Exit, policy: Policy, config: dict[str, Any], budget: Budget, progressed: bool, offload_ok: bool, at: _Where
) -> Decision:
    """The OOM ladder: the next memory-saving step, or the give-up that says what to try next. The
    budget counts the distinct configs that ran out of memory since the last progress."""
    tried = () if progressed and policy.refills else budget.tried
    sig = signature(config)
    tried = tried if sig in tried else (*tried, sig)
    n = len(tried)
    spent = replace(budget.spending(str(policy.budget), n), tried=tried)
    most = budget.most(str(policy.budget))
    step = _shrink_step(ex, config, offload_ok, most - n + 1)
    if isinstance(step, str):
        return Decision(Action.FAIL, step, budget=spent)
    edits, what = step
    micro = config.get("micro_batch_size" if is_v1(config) else "per_device_train_batch_size")
    count = f"[{n}/{most}]" if n <= most else f"[{n}/{most}, bottom of the ladder]"
    msg = f"{count} {policy.label}{at.step_text} (micro-batch {micro}): retrying with {what} {at.origin}"
    why = f"{policy.label}{at.step_text}: {what}"
    changes = tuple(Change(k, config.get(k), v, why) for k, v in edits.items())
    return Decision(Action.RETRY, msg, changes, spent)


def _shrink_step(
    ex: Exit, config: dict[str, Any], offload_ok: bool, retries_left: int
) -> tuple[dict[str, Any], str] | str:
    """(edits, what) for the next OOM attempt, or why the ladder gives up."""
    if is_v1(config):
        v1 = _v1_oom_step(config)
        if v1 is None:
            return (
                "out of memory at micro_batch_size 1 (a USE_V1 config): this config does not fit this card"
                + next_to_try(config, offload_ok)
            )
        return v1
    if ex.kind is FailureKind.EVAL_OOM:
        ev = int(config.get("per_device_eval_batch_size", 8) or 8)
        if ev <= 1:
            return "OOM during evaluation at eval batch 1: giving up"
        smaller = max(1, ev // 2) if retries_left > 1 else 1
        return {"per_device_eval_batch_size": smaller}, f"eval batch {smaller}"
    step_ = oom_step(config, offload_ok, retries_left=retries_left, numbers=ex.detail or None)
    if step_ is None:
        have = "gradient checkpointing on" + (" and ZeRO-3 CPU offload" if config.get("deepspeed") else "")
        return f"out of memory at micro-batch 1 with {have}: this config does not fit this card" + next_to_try(
            config, offload_ok
        )
    return step_
