"""The file side of a rollback after a divergence: read checkpoints, set them aside, lower the lr.

Decisions are ``ftlaunch.run.health.decide``; this module only touches the output_dir, and never deletes
a checkpoint: checkpoints after the rollback target are renamed after why: ``diverged-checkpoint-N-<time>`` (the
records say so: written after the first bad record, or the record after it is bad),
``badweights-checkpoint-N-<time>`` (the weight scan: non-finite or blown up), ``unverified-...`` (no
record to judge it by); a final model saved by a diverged attempt goes into ``diverged-final-<time>/``.
The weight scan is ``weights_child.py``, run by path with the trainer's Python (numpy, no torch).

Why the lr needs more than a config edit (measured, llamafactory 0.9.5 / transformers 5): resuming
restores the learning rate from the checkpoint's ``scheduler.pt`` (``base_lrs``) and ``optimizer.pt``
(``param_groups``), so a lower ``learning_rate`` in the YAML is silently ignored. The rollback
checkpoint is therefore rebuilt beside the original: weights hard-linked, the two state files
rewritten with the lr scaled, in a child process with the trainer's own Python (torch lives there).
The original is kept as ``rolledback-checkpoint-N-<time>``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ftlaunch.plan.memory.prediction import MemoryPrediction
from ftlaunch.run import transitions as journal
from ftlaunch.run.checkpoints import free_name, set_aside_incomplete
from ftlaunch.run.events import Event
from ftlaunch.run.health import (
    Checkpoint,
    Decision,
    Health,
    OnDiverge,
    Response,
    Thresholds,
    Verdict,
    decide,
    fp32_fits,
    judge,
    judge_checkpoints,
    judge_end,
    judge_weights,
    parse_console,
    thresholds_from,
    weights_verdict,
)
from ftlaunch.run.progress import checkpoint_dirs, checkpoint_problems
from ftlaunch.run.store import read_events, read_plan, read_state

# llamafactory refuses to start from scratch in an output_dir holding one of these (CHECKPOINT_NAMES).
FINAL_WEIGHTS = (
    "adapter_model.safetensors",
    "adapter_model.bin",
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)

_SCALE_LR = r"""
import os, sys, torch
path, target = sys.argv[1], float(sys.argv[2])
# The stored peak lr: the scheduler's base_lrs, else the optimizer's initial_lr; groups keep their ratios.
ref = None
GETS = (("scheduler.pt", lambda s: s["base_lrs"][0]), ("optimizer.pt", lambda s: s["param_groups"][0]["initial_lr"]))
for name, get in GETS:
    try:
        ref = ref or get(torch.load(f"{path}/{name}", weights_only=False, map_location="cpu"))
    except (FileNotFoundError, KeyError, IndexError, TypeError):
        pass
if not ref:
    sys.exit("no learning rate found in scheduler.pt or optimizer.pt")
factor = target / ref
for name in ("scheduler.pt", "optimizer.pt"):
    f = f"{path}/{name}"
    try:
        state = torch.load(f, weights_only=False, map_location="cpu")
    except FileNotFoundError:
        continue
    if name == "scheduler.pt":
        for key in ("base_lrs", "_last_lr"):
            if key in state:
                state[key] = [lr * factor for lr in state[key]]
    else:
        for g in state.get("param_groups", []):
            for key in ("lr", "initial_lr"):
                if key in g:
                    g[key] = g[key] * factor
    torch.save(state, f + ".tmp")
    os.replace(f + ".tmp", f)  # replaces the link, never the original checkpoint's file
print("scaled")
"""


def read_history(ckpt: Path) -> list[dict] | None:
    """A checkpoint's trainer_state.json log_history (NaN tokens parse); None when unreadable."""
    try:
        hist = json.loads((ckpt / "trainer_state.json").read_text()).get("log_history")
    except (OSError, ValueError, AttributeError):
        return None
    return hist if isinstance(hist, list) else None


WEIGHTS_CHILD = Path(__file__).with_name("weights_child.py")


def checkpoints_of(
    complete: Iterable[tuple[int, Path]],
    verdict: Verdict,
    t: Thresholds,
    *,
    fp16: bool,
    scan: Callable[[list[tuple[str, str]]], dict[str, Any]] | None = None,
    base: str | None = None,
    known_bad: Mapping[str, str] | None = None,
) -> list[Checkpoint]:
    """Complete checkpoints, judged on their own history, the record after each and (with ``scan``)
    their weights against the base model's (``base``: model_name_or_path). ``known_bad``: checkpoints
    a scan already ruled out (the end-of-run scan), with why."""
    complete = list(complete)
    cks = judge_checkpoints(verdict, [(s, p.name, read_history(p)) for s, p in complete], t, fp16=fp16)
    known = known_bad or {}
    cks = [replace(c, clean=False, why=known[c.name], aside_as="badweights") if c.name in known else c for c in cks]
    candidates = [(c.name, str(p)) for c, (_, p) in zip(cks, complete, strict=True) if c.clean]
    if scan is None or not candidates:
        return cks
    found = scan(candidates + ([("\0base", base)] if base else []))
    return judge_weights(cks, found, found.get("\0base"), t.weight_factor)


def scan_weights(python: str, folders: list[tuple[str, str]], timeout: float = 300) -> dict[str, Any]:
    """{label: scan} from weights_child.py in ``python``; {} when it cannot run (nothing ruled out, said)."""
    import tempfile

    spec = {"folders": [{"label": label, "path": path} for label, path in folders]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        r = subprocess.run([python, str(WEIGHTS_CHILD), f.name], capture_output=True, text=True, timeout=timeout)
        found = json.loads(r.stdout) if r.returncode == 0 else {}
    except (OSError, subprocess.SubprocessError, ValueError):
        found = {}
    finally:
        os.unlink(f.name)
    return found if isinstance(found, dict) else {}


def final_weights(output_dir: Path) -> list[Path]:
    """The model a finished run saved in output_dir itself (what ``set_aside_final`` moves)."""
    found = [output_dir / n for n in FINAL_WEIGHTS if (output_dir / n).is_file()]
    return found + sorted(output_dir.glob("model-*-of-*.safetensors"))


FINAL = "final model"  # the label of output_dir's own weights in an end-of-run scan


def end_scan_problems(
    out: Path,
    complete: list[tuple[int, Path]],
    last_step: int | None,
    scan: Callable[[list[tuple[str, str]]], dict[str, Any]],
    base: str | None,
    factor: float,
) -> tuple[list[Checkpoint], list[str]]:
    """What a finished run saved, scanned as a rollback scans its target: the final model in output_dir
    and the last complete checkpoint (and the first, the reference for adapters, whose tensors the base
    model does not share). Returns the ruled-out ones, oldest first; empty when all pass or nothing
    could be scanned (no safetensors, no numpy: the records decide); and the labels scanned."""
    picked = list(dict.fromkeys([complete[0], complete[-1]])) if complete else []
    folders = [(p.name, str(p)) for _, p in picked]
    step = max([s for s, _ in picked] + [last_step or 0])
    if final_weights(out):
        folders.append((FINAL, str(out)))
    if not folders:
        return [], []
    found = scan(folders + ([("\0base", base)] if base else []))
    cks = [Checkpoint(s, p.name, True) for s, p in picked] + (
        [Checkpoint(step, FINAL, True)] if FINAL in dict(folders) else []
    )
    judged = judge_weights(cks, found, found.get("\0base"), factor)
    return [c for c in judged if not c.clean], [label for label, _ in folders]


def set_aside(
    output_dir: Path, names: Iterable[str | tuple[str, str]], stamp: int, prefix: str = "diverged"
) -> list[str]:
    """Rename (never delete): llamafactory resumes from the last ``checkpoint-N`` by name. Each name
    may carry its own prefix (why it is set aside)."""
    moved = []
    for item in names:
        name, why = (item, prefix) if isinstance(item, str) else item
        src = output_dir / name
        if src.is_dir():
            target = free_name(output_dir, f"{why}-{name}-{stamp}")
            src.rename(target)
            moved.append(f"{name} -> {target.name}")
    return moved


def set_aside_final(output_dir: Path, stamp: int) -> list[str]:
    """A diverged attempt that reached the end saved its (garbage) model in output_dir: move it aside."""
    found = final_weights(output_dir)
    if not found:
        return []
    box = free_name(output_dir, f"diverged-final-{stamp}")
    box.mkdir()
    for f in found:
        f.rename(box / f.name)
    return [f"{f.name} -> {box.name}/" for f in found]


def python_of(trainer: str | None) -> str:
    """The Python that runs the trainer (its shebang), where torch is; else ours."""
    if trainer:
        try:
            with open(trainer, "rb") as f:
                first = f.readline(300).decode(errors="replace")
            if first.startswith("#!") and "python" in first:
                words = first[2:].split()
                exe = shutil.which(words[1]) if Path(words[0]).name == "env" and len(words) > 1 else words[0]
                if exe and os.access(exe, os.X_OK):
                    return exe
        except OSError:
            pass
    return sys.executable


def scale_lr(output_dir: Path, name: str, lr: float, python: str, stamp: int) -> str | None:
    """Rebuild ``name`` with its stored peak lr set to ``lr``; keep the original aside. An error or None."""
    src = output_dir / name
    tmp = output_dir / f".{name}.rollback-{stamp}"
    shutil.rmtree(tmp, ignore_errors=True)  # our own scratch copy from an interrupted rollback
    try:
        shutil.copytree(src, tmp, copy_function=_link_or_copy)
        # cwd: -c puts the working folder first on sys.path, and the trainer's Python may predate -P
        cmd = [python, "-c", _SCALE_LR, str(tmp), repr(lr)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp)
    except (OSError, subprocess.SubprocessError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return str(exc)
    if r.returncode != 0 or "scaled" not in r.stdout:
        shutil.rmtree(tmp, ignore_errors=True)
        return (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1][:300]
    src.rename(free_name(output_dir, f"rolledback-{name}-{stamp}"))
    tmp.rename(src)
    return None


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def now_stamp() -> int:
    return int(time.time())


# ---------------------------------------------------------------- what the supervisor calls


class HealthWatch:
    """Judges each new trainer record once, and carries out a rollback when the run diverges.

    The supervisor calls ``start`` before an attempt, ``feed`` with each batch of new records (True:
    halt the trainer now) and ``after`` once the trainer has exited (None: not diverged, carry on).
    """

    def __init__(
        self,
        run_dir: Path,
        values: Mapping[str, Any],
        env: Mapping[str, str],
        say: Callable[[str], None],
        write: Callable[[Callable[[], Any]], Any] = lambda fn: fn(),
    ):
        """``write`` carries out each state or event write: the supervisor passes its journal's
        best-effort one, so a full FTLAUNCH_HOME costs a record, never the verdict or the trainer."""
        self.run_dir = run_dir
        self.write = write
        self.policy = read_state(run_dir).on_diverge or OnDiverge.ROLLBACK
        self.env = env
        self.say = say
        try:
            self.thresholds = thresholds_from(env.get("FTLAUNCH_HEALTH"))
        except ValueError as exc:  # a typo must not kill a running supervisor: defaults, said aloud
            self.thresholds = Thresholds()
            say(f"ftlaunch: {exc}; numeric health uses its defaults (docs/health.md)")
        self.values = values  # the supervisor's live config: the fp32 rung changes fp16
        self.fp16 = bool(values.get("fp16"))
        self.verdict = Verdict()
        self.halt = False
        self.grad_norms, self.loss_steps, self.merged, self.last_console = [], [], 0, None
        self.known_bad: dict[str, str] = {}  # checkpoints the end-of-run scan ruled out, with why

    def _write(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.write(lambda: fn(*args, **kwargs))

    def start(self) -> None:
        self.verdict, self.halt = Verdict(), False
        self.fp16 = bool(self.values.get("fp16"))
        # grad_norm is only in the console: its k-th training-step line pairs with the k-th
        # trainer_log.jsonl record with a loss of the same attempt (both written by on_log, in order).
        self.grad_norms: list[str] = []  # appended by the supervisor's log-pump thread
        self.last_console: dict[str, Any] | None = None
        self.loss_steps: list[int | None] = []
        self.merged = 0
        self.known_bad = {}
        self._write(journal.health_judged, self.run_dir, self.verdict.to_dict())

    def console(self, line: str) -> None:
        """One line of the trainer's output (called from the log pump thread): keep its grad_norms."""
        for d in parse_console(line):
            # Several nodes (Slurm) each print the same reduced dict: keep one of identical neighbours.
            if d != self.last_console:
                self.grad_norms.append(d.get("grad_norm", ""))
            self.last_console = d

    def _with_grad_norms(self, records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        out: list[Mapping[str, Any]] = []
        norms = self.grad_norms
        while self.merged < min(len(norms), len(self.loss_steps)):  # console lines that came late
            out.append({"current_steps": self.loss_steps[self.merged], "grad_norm": norms[self.merged]})
            self.merged += 1
        for rec in records:
            if "loss" in rec:
                i = len(self.loss_steps)
                step = rec.get("current_steps")
                self.loss_steps.append(step if isinstance(step, int) else None)
                if i < len(norms):
                    rec = {**rec, "grad_norm": norms[i]}
                    self.merged = i + 1
            out.append(rec)
        return out

    def feed(self, records: Iterable[Mapping[str, Any]]) -> bool:
        records = self._with_grad_norms(records)
        before = self.verdict.health
        self.verdict = judge(records, self.thresholds, fp16=self.fp16, start=self.verdict)
        return self._told(before)

    def _told(self, before: Health) -> bool:
        """Record a change of health; a new divergence once (event, state, a marker in train.log)."""
        v = self.verdict
        if v.health is not before:
            self._write(journal.health_judged, self.run_dir, v.to_dict())
        if v.diverged and before is not Health.DIVERGED:
            b = v.first_bad
            self._write(
                journal.note,
                self.run_dir,
                Event.DIVERGED,
                step=b.step,
                signal=b.signal.value,
                values=b.values,
                policy=self.policy.value,
            )
            # `ftlaunch logs` shows the trainer's console: mark the first bad record there.
            self.say(f"ftlaunch: >>> first bad record: {v.message()} <<<")
            self.halt = self.policy is not OnDiverge.IGNORE
            return self.halt
        return False

    def judge_end(self, out: Path, values: Mapping[str, Any], weights_only: bool) -> None:
        """A trainer that finished (exit 0) is not yet a success: the records' tail is judged with the
        records there are (``health.judge_end``), and what it saved (the final model, the last complete
        checkpoint) goes through the weight scan a rollback uses. Either failing is a divergence, handled
        by ``after`` like any other (roll back to a clean checkpoint, or end ``diverged`` saying why)."""
        before = self.verdict.health
        self.verdict = judge_end(self.verdict, self.thresholds)
        scanned: list[str] = []  # labels
        t0 = time.monotonic()
        if not self.verdict.diverged:
            complete = [(s, p) for s, p in checkpoint_dirs(out) if not checkpoint_problems(p, weights_only)]
            python = python_of(self._trainer())
            bad, scanned = end_scan_problems(
                out,
                complete,
                self.verdict.good_steps[-1] if self.verdict.good_steps else None,
                lambda folders: scan_weights(python, folders),
                str(values.get("model_name_or_path") or "") or None,
                self.thresholds.weight_factor,
            )
            if bad:
                self.known_bad = {c.name: c.why for c in bad if c.name != FINAL}
                first = bad[0]
                self.verdict = weights_verdict(self.verdict, first.step, first.name, first.why)
        self._write(
            journal.note,
            self.run_dir,
            Event.END_JUDGED,
            healthy=not self.verdict.diverged,
            scanned=scanned,
            weight_scan_s=round(time.monotonic() - t0, 3),
            verdict=self.verdict.message(),
        )
        self._told(before)

    def _trainer(self) -> str | None:
        from ftlaunch.run.trainer import find_trainer

        try:
            cmd = find_trainer(self.env)
            return str(cmd[0]) if cmd else None
        except Exception:  # noqa: BLE001 - any failure: fall back to our own Python
            return None

    def tried(self) -> list[str]:
        """Remedies of the rollbacks since the run was created or last resumed by hand (a resume refills them)."""
        done: list[str] = []
        for ev in read_events(self.run_dir):
            if ev.get("event") == Event.RESUMED:
                done = []
            elif ev.get("event") == Event.ROLLED_BACK:
                done.append(str(ev.get("remedy")))
        return done

    def after(self, out: Path, values: dict[str, Any], weights_only: bool, *, done: bool = False) -> Decision | None:
        """After a diverged attempt: set checkpoints aside, prepare the rollback; None when healthy.
        ``done``: the trainer exited 0 on its own, so its end is judged first (``judge_end``)."""
        self.feed([])  # console grad_norms that arrived after the last record
        if done and not self.verdict.diverged:
            self.judge_end(out, values, weights_only)
        if not self.verdict.diverged or self.policy is OnDiverge.IGNORE:
            return None
        d, cks, complete, python, scanned = self._decide(out, values, weights_only)
        stamp = now_stamp()
        listed, kept, older = self._set_aside(out, d, cks, weights_only, stamp)
        if d.action is Response.ROLLBACK and "learning_rate" in d.edits and d.resume_from:
            err = scale_lr(out, d.resume_from, d.edits["learning_rate"], python, stamp)
            if err:
                d = replace(
                    d,
                    action=Response.GIVE_UP,
                    message=f"{d.message}; but the lr in {d.resume_from} could not be lowered ({err}): giving up",
                )
        d = replace(d, message=f"{d.message}; {aside_tail(d, listed, kept, older)}")
        if d.action is Response.ROLLBACK:
            self._write(
                journal.note,
                self.run_dir,
                Event.ROLLED_BACK,
                resume_from=d.resume_from,
                edits=d.edits,
                message=d.message,
                remedy=d.remedy,
                weight_scan_s=round(scanned, 3),
            )
        target = next((s for s, p in complete if p.name == d.resume_from), None)  # set-aside ones are gone
        self._write(journal.divergence_handled, self.run_dir, self.verdict.to_dict(), target)
        self.say(f"ftlaunch: {d.message}")
        return d

    def _decide(
        self, out: Path, values: dict[str, Any], weights_only: bool
    ) -> tuple[Decision, list[Checkpoint], list[tuple[int, Path]], str, float]:
        """Scan the complete checkpoints and decide: (decision, checkpoints, complete ones, python, scan seconds)."""
        plan = read_plan(self.run_dir)
        tried = self.tried()
        complete = [(s, p) for s, p in checkpoint_dirs(out) if not checkpoint_problems(p, weights_only)]
        python = python_of(self._trainer())
        t0 = time.monotonic()
        cks = checkpoints_of(
            complete,
            self.verdict,
            self.thresholds,
            fp16=self.fp16,
            scan=lambda folders: scan_weights(python, folders),
            base=str(values.get("model_name_or_path") or "") or None,
            known_bad=self.known_bad,
        )
        scanned = time.monotonic() - t0
        d = decide(
            self.verdict,
            self.policy,
            values,
            cks,
            rollbacks_used=len(tried),
            fp32_fits=fp32_fits(MemoryPrediction.from_dict(plan.get("memory"))),
            tried=tried,
        )
        return d, cks, complete, python, scanned

    def _set_aside(
        self, out: Path, d: Decision, cks: list[Checkpoint], weights_only: bool, stamp: int
    ) -> tuple[list[str], list[str], list[str]]:
        """Set aside what the decision names, the final weights and a save cut short: (listed, kept, older)."""
        moved = set_aside(out, d.set_aside, stamp) + set_aside_final(out, stamp)
        why = {c.name: c.why for c in cks}
        listed = [f"{m} ({why[m.split(' -> ')[0]]})" if why.get(m.split(" -> ")[0]) else m for m in moved]
        # A save the stop cut short is now the newest checkpoint-N: llamafactory would pick it by name and
        # fail, and "left in place: none" would not be true (issue 31). Set aside as the next attempt would.
        try:
            partial = set_aside_incomplete(out, weights_only, stamp)
        except OSError:  # a name taken, a read-only folder: said below as left in place
            partial = []
        moved += [f"{a.name} -> {a.moved_to}" for a in partial]
        listed += [f"{a.name} -> {a.moved_to} (incomplete: {'; '.join(a.problems)})" for a in partial]
        if moved:
            self._write(journal.note, self.run_dir, Event.CHECKPOINT_SET_ASIDE, reason="diverged", moved=moved)
        aside = {name for name, _ in d.set_aside}
        kept = [c.name for c in sorted(cks, key=lambda c: c.step) if c.name not in aside]
        older = [p.name for _, p in checkpoint_dirs(out) if p.name not in kept]  # incomplete ones still there
        return listed, kept, older


def aside_tail(d: Decision, listed: list[str], kept: list[str], older: list[str]) -> str:
    """What a rollback decision's message says of the checkpoints: set aside, and (no rollback) left in place."""
    tail = f"set aside: {', '.join(listed)}" if listed else "nothing set aside"
    if d.action is not Response.ROLLBACK:
        if older:
            tail += f"; incomplete, left as they are: {', '.join(older)}"
        tail += f"; every checkpoint is kept; left in place: {', '.join(kept) or 'none'}"
    return tail
