"""Probing this machine, and reading a hardware file: the shells that make a ``Hardware`` value.

The probe never imports torch. Order: NVML (nvidia-ml-py), then ``nvidia-smi --query-gpu``, then
"no GPU"; each failed step is recorded in ``Hardware.notes`` so a silent fallback cannot hide. NVML
is reached through a pynvml-like module passed in (``nvml_loader``), so tests pass a recorded one.
The parsers and checks they feed are pure, in ftlaunch.plan.hardware.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ftlaunch.errors import HardwareError
from ftlaunch.files import HARDWARE_LIMIT, read_user_text
from ftlaunch.plan.hardware import (
    NVIDIA_SMI_QUERY,
    NVML_P2P_CAPS_INDEX_READ,
    Gpu,
    Hardware,
    blocked_pairs,
    filter_visible,
    hardware_from_json,
    parse_nvidia_smi_csv,
)


def load_hardware_file(path: str | Path) -> Hardware:
    """A ``--hardware`` file: a regular file of at most HARDWARE_LIMIT (not /dev/zero, not a FIFO)."""
    p = Path(path)
    try:
        text = read_user_text(
            p,
            limit=HARDWARE_LIMIT,
            what=f"hardware file {p}",
            error=HardwareError,
            hint="write it with `ftlaunch env --json > hw.json`",
        )
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise HardwareError(f"hardware file {p} does not exist") from exc
    return hardware_from_json(text, p)


def gpus_from_nvml(nvml: Any) -> tuple[list[Gpu], str | None]:
    """Read GPUs through a pynvml-like module (injected, so tests can pass a recorded one)."""
    nvml.nvmlInit()
    try:
        driver = nvml.nvmlSystemGetDriverVersion()
        if isinstance(driver, bytes):
            driver = driver.decode()
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(h)
            if isinstance(name, bytes):
                name = name.decode()
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            try:
                cc = tuple(nvml.nvmlDeviceGetCudaComputeCapability(h))
            except Exception:  # old drivers lack the call; unknown capability fails closed
                cc = None
            uuid = nvml.nvmlDeviceGetUUID(h)
            if isinstance(uuid, bytes):
                uuid = uuid.decode()
            gpus.append(
                Gpu(
                    index=i,
                    name=str(name),
                    total_mib=int(mem.total // (1024 * 1024)),
                    free_mib=int(mem.free // (1024 * 1024)),
                    compute_capability=cc,  # type: ignore[arg-type]
                    uuid=uuid,
                )
            )
        return gpus, driver
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def p2p_from_nvml(nvml: Any) -> dict[tuple[str, str], int]:
    """(uuid, uuid) -> P2P read status for every pair of GPUs, through a pynvml-like module."""
    nvml.nvmlInit()
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        uuids = []
        for h in handles:
            u = nvml.nvmlDeviceGetUUID(h)
            uuids.append(u.decode() if isinstance(u, bytes) else str(u))
        caps = getattr(nvml, "NVML_P2P_CAPS_INDEX_READ", NVML_P2P_CAPS_INDEX_READ)
        out: dict[tuple[str, str], int] = {}
        for i, hi in enumerate(handles):
            for j in range(i + 1, len(handles)):
                out[(uuids[i], uuids[j])] = int(nvml.nvmlDeviceGetP2PStatus(hi, handles[j], caps))
        return out
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def load_pynvml() -> Any:
    import pynvml  # nvidia-ml-py; light, no CUDA runtime needed

    return pynvml


def _run_nvidia_smi() -> str:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise FileNotFoundError("nvidia-smi not on PATH")
    out = subprocess.run(
        [exe, f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=15,
        check=True,
    )
    return out.stdout


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for pkg in ("ftlaunch", "llamafactory", "torch", "transformers", "deepspeed", "peft"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def host_memory() -> tuple[float, float]:
    """(total, available) host RAM in GiB, from psutil: what a plan that trains on this machine's CPU
    is checked against (plan/memory/host.py)."""
    import psutil

    vm = psutil.virtual_memory()
    return round(vm.total / 2**30, 2), round(vm.available / 2**30, 2)


def probe(
    env: Mapping[str, str],
    *,
    disk_path: str | Path = ".",
    nvml_loader: Callable[[], Any] = load_pynvml,
    smi_runner: Callable[[], str] = _run_nvidia_smi,
) -> Hardware:
    """Probe this machine. Never raises for a missing GPU: records why in ``notes``."""
    notes: list[str] = []
    gpus: list[Gpu] = []
    driver: str | None = None
    source = "none"
    try:
        gpus, driver = gpus_from_nvml(nvml_loader())
        source = "nvml"
    except Exception as exc:  # NVML missing or no driver: fall back, but say why
        notes.append(f"NVML unavailable: {exc}")
        try:
            gpus, driver = parse_nvidia_smi_csv(smi_runner())
            source = "nvidia-smi"
        except Exception as exc2:
            notes.append(f"nvidia-smi unavailable: {exc2}")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if gpus and visible is not None:
        before = len(gpus)
        gpus = filter_visible(gpus, visible)
        notes.append(f"CUDA_VISIBLE_DEVICES={visible!r}: {len(gpus)} of {before} GPUs visible")
    blocked: tuple[tuple[int, int], ...] = ()
    if len(gpus) > 1:
        try:
            blocked = blocked_pairs(p2p_from_nvml(nvml_loader()), gpus)
        except Exception as exc:  # no NVML: nvidia-smi cannot say; assume P2P (data-centre default), say so
            notes.append(f"peer-to-peer access between GPUs unknown (NVML: {exc}); assumed available")
        if blocked:
            notes.append(f"no peer-to-peer access between GPUs {blocked} (NVML): NCCL_P2P_DISABLE=1 is planned")
    total_ram, available_ram = host_memory()
    disk_dir = Path(disk_path)
    while not disk_dir.exists() and disk_dir != disk_dir.parent:
        disk_dir = disk_dir.parent
    try:
        disk_free = shutil.disk_usage(disk_dir).free / 2**30
    except OSError:
        disk_free = None
    return Hardware(
        gpus=tuple(gpus),
        source=source,
        driver_version=driver,
        host_ram_gib=total_ram,
        host_available_gib=available_ram,
        disk_free_gib=None if disk_free is None else round(disk_free, 2),
        cpu_count=os.cpu_count(),
        versions=_versions(),
        notes=tuple(notes),
        p2p_blocked=blocked,
    )
