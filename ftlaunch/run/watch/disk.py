"""The disk watch: free space before an expected save. When the next save is close (within ~10 s at
the current rate, else the next step) and the filesystem cannot hold one more checkpoint, the trainer
is halted now rather than left to write a partial one. After an ENOSPC, the failed save's partial
folder is removed. The sizes and the verdict are ftlaunch.plan.disk's; the measuring ftlaunch.run.disk's."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftlaunch.plan.disk import DiskForecast, enough_for_save
from ftlaunch.run import progress as prog
from ftlaunch.run.disk import DISK_HINT, disk_message, free_for_next_save, remove_partial
from ftlaunch.run.journal import RunJournal
from ftlaunch.run.recovery import Exit, Halt
from ftlaunch.run.state import FailureKind
from ftlaunch.run.watch import Seen


class DiskWatch:
    def __init__(self, journal: RunJournal, out: Path, forecast: DiskForecast):
        self.journal, self.out, self.forecast = journal, out, forecast

    def start(self, pid: int) -> None:
        pass

    def tick(self, seen: Seen) -> Halt | None:
        if seen.rc is not None or not seen.new or seen.halting:  # a statvfs per new step record: microseconds
            return None
        why = self.before_save(seen.step or 0, seen.rate)
        return Halt(FailureKind.DISK_FULL, why) if why is not None else None

    def after(self, seen: Seen) -> None:
        pass

    def before_save(self, step: int, steps_per_second: float | None) -> str | None:
        fc, out = self.forecast, self.out
        nxt = fc.next_save_after(step)
        if nxt is None or nxt - step > max(1, round((steps_per_second or 0.0) * 10)):
            return None
        try:
            free = free_for_next_save(out, fc, step, nxt)  # a save under way counted as it will end
        except OSError:
            return None
        if enough_for_save(fc, free):
            return None
        why = f"the save at step {nxt} cannot fit: {disk_message(out, fc.checkpoint_bytes, free)}"
        self.journal.say(f"ftlaunch: {why}; stopping the trainer before it writes a partial checkpoint")
        return why


def after_disk_full(ex: Exit, out: Path, weights_only: bool, fc: Mapping[str, Any] | None, journal: RunJournal) -> Exit:
    """ENOSPC (or the check before a save): remove only the partial folder of the failed save (it can
    never be resumed), keep every complete checkpoint, and say where the space went."""
    removed = remove_partial(out, weights_only)
    size = DiskForecast.from_dict(fc).checkpoint_bytes if fc else None
    last = prog.last_complete_checkpoint(out, weights_only)
    parts = [ex.message] if ex.message else []
    if not ex.message.startswith("the save at step"):
        parts.append(disk_message(out, size))
    if removed.names:
        parts.append(f"removed the partial {', '.join(removed.names)} ({removed.bytes_freed} bytes)")
    parts.append(f"kept every complete checkpoint (last: {last[1].name})" if last else "no complete checkpoint yet")
    if removed.names:
        journal.partial_removed(list(removed.names), removed.bytes_freed)
    return Exit(FailureKind.DISK_FULL, "; ".join(parts) + f"; {DISK_HINT}")
