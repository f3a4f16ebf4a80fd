"""Clean restarts on a GPU: before the next attempt, wait until the old trainer's processes are gone
from NVML and the memory in use is back near the figure measured before the first attempt, bounded
(nvidia-resiliency-ext waits for memory under 512 MB, at most 50 s). A driver frees a killed
process's memory some time after the process is gone; an attempt started before then may OOM for
nothing.

``wait_gpu_released`` is the pure loop over injected probes, clock and sleep; ``nvml_probes`` and
``gpu_used_mib`` are the thin NVML shell (through ftlaunch.probe, never torch). With no GPU
or no NVML the probes say None and the wait ends at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ftlaunch.plan.hardware import filter_visible
from ftlaunch.probe.hardware import gpus_from_nvml, load_pynvml
from ftlaunch.probe.usage import gpu_memory_of


@dataclass(frozen=True)
class GpuWait:
    """How a wait for the GPU ended. ``released``: the old processes are gone and the memory is
    back near the start figure (also True when there was nothing to wait for: ``skipped``)."""

    waited_s: float
    released: bool
    used_mib: float | None  # in use when the wait ended; None: NVML cannot tell
    baseline_mib: float | None = None
    near_mib: float = 512.0
    pids_gone: bool = True
    skipped: bool = False  # no GPU or no NVML: nothing was waited for

    @property
    def message(self) -> str:
        """What to say in train.log and the events: how long it waited, and for what."""
        if self.skipped:
            return "no GPU memory figure (no GPU or no NVML): next attempt not held back"
        used = "?" if self.used_mib is None else f"{self.used_mib:.0f}"
        start = "" if self.baseline_mib is None else f", {self.baseline_mib:.0f} MiB before the first attempt"
        if self.released:
            return f"GPU released after {self.waited_s:.1f} s ({used} MiB in use{start})"
        still = [] if self.pids_gone else ["the old trainer's processes still hold GPU memory"]
        if self.baseline_mib is not None and (self.used_mib is None or self.used_mib > self.limit_mib):
            still.append(f"{used} MiB in use, more than {self.limit_mib:.0f} ({self.near_mib:.0f} above the start)")
        return f"GPU not released after {self.waited_s:.1f} s: {'; '.join(still) or 'NVML stopped answering'}"

    @property
    def limit_mib(self) -> float:
        return (self.baseline_mib or 0.0) + self.near_mib


def wait_gpu_released(
    pids_gone: Callable[[], bool],
    used_mib: Callable[[], float | None],
    baseline_mib: float | None,
    *,
    bound_s: float = 50.0,
    near_mib: float = 512.0,
    poll_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> GpuWait:
    """Wait until ``pids_gone()`` and ``used_mib()`` <= ``baseline_mib`` + ``near_mib``, at most
    ``bound_s`` s, polling every ``poll_s`` s. Pure but for the injected probes, clock and sleep.

    ``used_mib()`` None at the first poll (no GPU, no NVML): no wait at all. ``baseline_mib`` None
    (not measured): only the processes are waited for."""
    t0 = clock()
    used = used_mib()
    if used is None:
        return GpuWait(0.0, True, None, baseline_mib, near_mib, skipped=True)
    while True:
        gone = pids_gone()
        near = used is not None and (baseline_mib is None or used <= baseline_mib + near_mib)
        waited = clock() - t0
        if gone and near:
            return GpuWait(waited, True, used, baseline_mib, near_mib)
        if waited >= bound_s:
            return GpuWait(waited, False, used, baseline_mib, near_mib, pids_gone=gone)
        sleep(max(0.0, min(poll_s, bound_s - waited)))
        used = used_mib()


# ---------------------------------------------------------------- the NVML shell


def gpu_used_mib(visible: str | None = None, nvml_loader: Callable[[], Any] = load_pynvml) -> float | None:
    """MiB in use on the GPUs the trainer sees (CUDA_VISIBLE_DEVICES ``visible``), all processes
    together; None when NVML cannot tell (no GPU, no driver, none visible)."""
    try:
        gpus, _ = gpus_from_nvml(nvml_loader())
    except Exception:
        return None
    gpus = filter_visible(gpus, visible)
    if not gpus or any(g.free_mib is None for g in gpus):
        return None
    return float(sum(g.total_mib - (g.free_mib or 0) for g in gpus))


def gpu_pids_gone(pids: Iterable[int], nvml_loader: Callable[[], Any] = load_pynvml) -> bool:
    """None of these processes holds GPU memory, per NVML (True when NVML cannot tell: then
    ``gpu_used_mib`` is None too and nothing is waited for). In a container NVML may list host pids
    that match none of ours: the memory figure is what the wait then rests on."""
    return not gpu_memory_of(set(pids), nvml_loader)


def nvml_probes(
    pids: Iterable[int], visible: str | None = None, nvml_loader: Callable[[], Any] = load_pynvml
) -> tuple[Callable[[], bool], Callable[[], float | None]]:
    """The (pids_gone, used_mib) pair for ``wait_gpu_released``: ``pids`` are the old trainer's
    processes (its group), ``visible`` the trainer's CUDA_VISIBLE_DEVICES."""
    old = frozenset(pids)
    return (lambda: gpu_pids_gone(old, nvml_loader)), (lambda: gpu_used_mib(visible, nvml_loader))
