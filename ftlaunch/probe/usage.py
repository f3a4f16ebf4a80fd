"""The runtime GPU sampler: the GPU memory a run's processes hold, per NVML (never torch).

The supervisor samples the busiest GPU's peak (``gpu_peak_of``) to learn what a config really used;
the status view shows all GPUs together (``gpu_memory_of``); the GPU wait asks whether the trainer's
processes still hold any. With no GPU or no driver each says None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ftlaunch.probe.hardware import load_pynvml


def _usage_per_device(pids: set[int], nvml_loader: Callable[[], Any]) -> list[int] | None:
    """Bytes these processes use on each GPU, per NVML; None when NVML cannot tell."""
    try:
        nvml = nvml_loader()
        nvml.nvmlInit()
    except Exception:
        return None
    try:
        out = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            out.append(sum(int(proc.usedGpuMemory or 0) for proc in procs if proc.pid in pids))
        return out
    except Exception:
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def gpu_memory_of(pids: set[int], nvml_loader: Callable[[], Any] = load_pynvml) -> float | None:
    """GiB of GPU memory used by these processes, all GPUs together, per NVML; None when NVML cannot tell."""
    used = _usage_per_device(pids, nvml_loader)
    return None if used is None else round(sum(used) / 2**30, 2)


def gpu_peak_of(pids: set[int], nvml_loader: Callable[[], Any] = load_pynvml) -> float | None:
    """GiB used by these processes on the busiest GPU (the memory model is per GPU); None when NVML
    cannot tell (no GPU, no driver) or they hold no GPU memory."""
    busiest = max(_usage_per_device(pids, nvml_loader) or [], default=0)
    return round(busiest / 2**30, 3) if busiest else None
