"""Reading what the trainer writes: trainer_log.jsonl progress and checkpoint-N directories.

Pure helpers over text and directory listings; the supervisor and ``status`` call them.
"""

from __future__ import annotations

import json
import re
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ftlaunch.run.store import json_lines

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin", "adapter_model.bin")
# What torch.save wrote in a checkpoint (optimizer.pt, scheduler.pt, scaler.pt, rng_state*.pth, *.bin weights,
# training_args.bin; DeepSpeed's global_stepN/*.pt): each is checked as readable by its zip structure.
TORCH_FILES = ("*.pt", "*.pth", "*.bin", "global_step*/*.pt")
ZIP_MAGIC = b"PK\x03\x04"  # a zip's local file header; torch.save writes a zip since torch 1.6
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length: 30 bytes


@dataclass(frozen=True)
class Progress:
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    lr: float | None = None
    epoch: float | None = None
    throughput: float | None = None  # tokens/s when llamafactory counts tokens
    total_tokens: int | None = None
    vram_gib: float | None = None
    # Recovering: the furthest step an earlier attempt reached ("recovering" lasts until it is passed,
    # even when this attempt fails first); None once passed, or when nothing is being recovered.
    furthest: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _step_of(rec: dict[str, Any]) -> Any:
    # v0 (LLaMA-Factory's LogCallback) writes current_steps; the v1 trainer (USE_V1) writes step.
    return rec.get("current_steps", rec.get("step"))


def _is_step_record(rec: dict[str, Any]) -> bool:
    steps = _step_of(rec)
    return isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0


def parse_trainer_log(text: str | bytes) -> list[dict[str, Any]]:
    """Step records of trainer_log.jsonl. Torn, half-written and foreign lines are skipped (a line
    being written right now is one of them); a record's ``current_steps`` is always an int (a v1
    trainer's ``step`` is read as it)."""
    data = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text
    records = json_lines(data, _is_step_record)[0]
    return [r if "current_steps" in r else {**r, "current_steps": r["step"]} for r in records]


def resume_point(before: dict[str, Any] | None, step: int) -> Progress:
    """A recovering attempt's progress until its trainer logs a step: the step it resumes from (its
    checkpoint's, 0 from the base model) of the same total. ``status`` then shows where training goes
    on from and an ETA from there at the earlier rate, not the furthest step's, counted down to
    ``ETA 0m00s`` while the trainer loads (issue 31)."""
    before = before or {}
    total = before.get("total_steps")
    return Progress(
        step=step, total_steps=total if isinstance(total, int) else None, furthest=furthest_step(before) or None
    )


def furthest_step(progress: dict[str, Any] | None) -> int:
    """The furthest step a run's recorded progress says was reached (its step, or the step a
    recovering attempt has not yet passed)."""
    p = progress or {}
    steps = [v for v in (p.get("step"), p.get("furthest")) if isinstance(v, int) and not isinstance(v, bool)]
    return max(steps, default=0)


def latest_progress(records: list[dict[str, Any]], furthest: int | None = None) -> Progress:
    """Fold records into one view: the last step, the last loss seen (the final record has none).
    ``furthest``: the step a recovering attempt must pass (kept while it has not)."""
    p: dict[str, Any] = {}
    for rec in records:
        p["step"] = rec.get("current_steps", p.get("step"))
        p["total_steps"] = rec.get("total_steps", p.get("total_steps"))
        p["epoch"] = rec.get("epoch", p.get("epoch"))
        for key in ("loss", "lr", "throughput", "total_tokens"):
            if rec.get(key) is not None:
                p[key] = rec[key]
        if rec.get("vram_allocated") is not None:
            p["vram_gib"] = rec["vram_allocated"]
    if furthest and (p.get("step") or 0) <= furthest:
        p["furthest"] = furthest
    return Progress(**p)


def checkpoint_dirs(output_dir: Path) -> list[tuple[int, Path]]:
    if not output_dir.is_dir():
        return []
    found = []
    for p in output_dir.iterdir():
        m = CHECKPOINT_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def _safetensors_header_ok(path: Path) -> bool:
    """A safetensors file starts with an 8-byte little-endian length and that much JSON."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                return False
            (n,) = struct.unpack("<Q", raw)
            if n <= 0 or n > 100 * 2**20:
                return False
            header = f.read(n)
            if len(header) != n:
                return False
            json.loads(header)
            size = path.stat().st_size
            meta = json.loads(header)
            end = max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"), default=0)
            return size >= 8 + n + end
    except (OSError, ValueError, KeyError, TypeError):
        return False


def torch_file_problem(path: Path) -> str | None:
    """Why torch.load would fail on ``path`` for want of bytes, judged without torch; None when it is whole.

    torch.save writes a zip archive: it is whole when its end-of-central-directory record is there (a
    file cut short has lost it: torch's "failed finding central directory"), its central directory
    reads, and every entry's local header sits where the directory says, its data ending before the
    next entry (or the directory) begins. No entry is decompressed and no CRC is computed: a few reads
    per entry, milliseconds for a multi-GB optimizer.pt (scripts/bench_checkpoint_check.py)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            if not head:
                return "empty"
            if ZIP_MAGIC.startswith(head) and head != ZIP_MAGIC:
                return f"cut short at {len(head)} bytes"
            if head != ZIP_MAGIC:
                # Not a zip: torch.save's legacy format (before torch 1.6, or _use_new_zipfile_serialization=
                # False) is a bare pickle stream with no index to check short of unpickling it: accepted.
                return None
            with zipfile.ZipFile(f) as archive:
                return _zip_entries_problem(f, archive.infolist(), archive.start_dir)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error) as exc:
        return f"its zip index does not read: {exc}"


def _zip_entries_problem(f: IO[bytes], entries: list[zipfile.ZipInfo], directory: int) -> str | None:
    """The first entry whose local header is missing or whose data runs past the next one's start."""
    if not entries:
        return "its zip archive lists no entries"
    entries = sorted(entries, key=lambda e: e.header_offset)
    limits = [e.header_offset for e in entries[1:]] + [directory]
    for entry, limit in zip(entries, limits, strict=True):
        f.seek(entry.header_offset)
        raw = f.read(_LOCAL_HEADER.size)
        if len(raw) < _LOCAL_HEADER.size or raw[:4] != ZIP_MAGIC:
            return f"no local header for {entry.filename} at byte {entry.header_offset}"
        _, name_len, extra_len = _LOCAL_HEADER.unpack(raw)
        end = entry.header_offset + _LOCAL_HEADER.size + name_len + extra_len + entry.compress_size
        if end > limit:
            return f"{entry.filename} runs past byte {limit}"
    return None


def torch_files(ckpt: Path) -> list[Path]:
    """The files torch.save wrote in a checkpoint (TORCH_FILES), sorted."""
    return sorted({p for pattern in TORCH_FILES for p in ckpt.glob(pattern) if p.is_file()})


def checkpoint_problems(ckpt: Path, weights_only: bool = False) -> list[str]:
    """Why a checkpoint is not complete; empty when it is.

    Complete = trainer_state.json parses, weights exist (safetensors headers and sizes check out),
    every file torch.save wrote is a whole zip (``torch_file_problem``: optimizer, scheduler, rng
    states, .bin weights, DeepSpeed's global_stepN/), and optimizer state exists unless the run saves
    weights only.
    """
    problems = []
    state = ckpt / "trainer_state.json"
    try:
        json.loads(state.read_text())
    except (OSError, ValueError):
        problems.append("trainer_state.json missing or unreadable")
    weights = [ckpt / w for w in WEIGHT_FILES if (ckpt / w).exists()]
    index = list(ckpt.glob("*.safetensors.index.json"))
    if index:
        try:
            shards = set(json.loads(index[0].read_text())["weight_map"].values())
            weights += [ckpt / s for s in shards]
            missing = [s for s in shards if not (ckpt / s).exists()]
            if missing:
                problems.append(f"missing shards: {', '.join(sorted(missing))}")
        except (OSError, ValueError, KeyError):
            problems.append(f"{index[0].name} unreadable")
    if not weights:
        problems.append("no weights file")
    for w in weights:
        if w.suffix == ".safetensors" and w.exists() and not _safetensors_header_ok(w):
            problems.append(f"{w.name} is truncated or corrupt")
    for t in torch_files(ckpt):
        if (why := torch_file_problem(t)) is not None:
            problems.append(f"{t.relative_to(ckpt)} is truncated or corrupt ({why})")
    # DeepSpeed saves optimizer state under global_stepN/; the HF Trainer as optimizer.pt.
    has_opt = (ckpt / "optimizer.pt").exists() or any(ckpt.glob("global_step*"))
    if not has_opt and not weights_only:  # save_only_model: true keeps no optimizer state
        problems.append("optimizer.pt missing")
    return problems


def last_complete_checkpoint(output_dir: Path, weights_only: bool = False) -> tuple[int, Path] | None:
    for step, path in reversed(checkpoint_dirs(output_dir)):
        if not checkpoint_problems(path, weights_only):
            return step, path
    return None


class StepRate:
    """Optimizer steps per second of one attempt, from the first step record it saw to the latest."""

    def __init__(self) -> None:
        self.first: tuple[int, float] | None = None
        self.rate: float | None = None  # the latest figure

    def update(self, first_step: int, last_step: int, now: float) -> float | None:
        if self.first is None:
            self.first = (first_step, now)
        step0, t0 = self.first
        self.rate = (last_step - step0) / (now - t0) if last_step > step0 and now > t0 else None
        return self.rate
