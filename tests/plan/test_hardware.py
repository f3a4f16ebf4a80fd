"""Hardware: parsers on captured nvidia-smi/NVML output, CUDA_VISIBLE_DEVICES, catalog, probe fallbacks."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ftlaunch.errors import HardwareError
from ftlaunch.plan.hardware import (
    Hardware,
    catalog_hardware,
    filter_visible,
    parse_nvidia_smi_csv,
)
from ftlaunch.probe.hardware import gpus_from_nvml, load_hardware_file, probe

DATA = Path(__file__).parent.parent / "data"


def test_parse_nvidia_smi_capture():
    gpus, driver = parse_nvidia_smi_csv((DATA / "nvidia-smi-4xa100.csv").read_text())
    assert len(gpus) == 4 and driver == "550.54.15"
    assert gpus[2].free_mib == 2048 and gpus[0].compute_capability == (8, 0)
    assert gpus[0].bf16 and round(gpus[0].total_gib) == 80
    v100, _ = parse_nvidia_smi_csv((DATA / "nvidia-smi-v100.csv").read_text())
    assert not v100[0].bf16 and v100[0].compute_capability == (7, 0)


def test_parse_nvidia_smi_garbage_fails_loudly():
    with pytest.raises(HardwareError):
        parse_nvidia_smi_csv("NVIDIA-SMI has failed because it couldn't communicate with the driver")


def test_cuda_visible_devices_like_cuda():
    gpus, _ = parse_nvidia_smi_csv((DATA / "nvidia-smi-4xa100.csv").read_text())
    assert [g.uuid for g in filter_visible(gpus, "2,0")] == [gpus[2].uuid, gpus[0].uuid]
    assert [g.index for g in filter_visible(gpus, "2,0")] == [0, 1]  # renumbered as the trainer sees them
    assert filter_visible(gpus, "") == []
    assert len(filter_visible(gpus, "1,7,2")) == 1  # CUDA stops at the first invalid entry
    assert filter_visible(gpus, "GPU-6c3e")[0].uuid == gpus[2].uuid
    assert filter_visible(gpus, None) == gpus


class FakeNvml:
    """A recorded pynvml: two T4s as NVML reported them on a real machine."""

    def __init__(self, fail=False):
        self.fail = fail
        self.shutdown = False

    def nvmlInit(self):
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shutdown = True

    def nvmlSystemGetDriverVersion(self):
        return b"535.104.05"

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return "Tesla T4"

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=16106127360, free=15642329088 - h * 2**30, used=0)

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return (7, 5)

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-0000000{h}-aaaa-bbbb-cccc-dddddddddddd"


def test_gpus_from_nvml():
    nv = FakeNvml()
    gpus, driver = gpus_from_nvml(nv)
    assert driver == "535.104.05" and len(gpus) == 2 and nv.shutdown
    assert gpus[0].total_mib == 15360 and gpus[0].compute_capability == (7, 5) and not gpus[0].bf16


def test_probe_falls_back_and_says_why(tmp_path):
    def no_smi():
        raise FileNotFoundError("nvidia-smi not on PATH")

    hw = probe({}, disk_path=tmp_path, nvml_loader=lambda: FakeNvml(fail=True), smi_runner=no_smi)
    assert hw.gpus == () and hw.source == "none"
    assert any("NVML" in n for n in hw.notes) and any("nvidia-smi" in n for n in hw.notes)
    assert hw.host_ram_gib and hw.disk_free_gib is not None
    hw2 = probe(
        {"CUDA_VISIBLE_DEVICES": "1"},
        disk_path=tmp_path,
        nvml_loader=lambda: FakeNvml(fail=True),
        smi_runner=lambda: (DATA / "nvidia-smi-4xa100.csv").read_text(),
    )
    assert hw2.source == "nvidia-smi" and hw2.gpu_count == 1


def test_probe_uses_nvml_first(tmp_path):
    hw = probe({}, disk_path=tmp_path, nvml_loader=FakeNvml, smi_runner=lambda: "")
    assert hw.source == "nvml" and hw.gpu_count == 2


@pytest.mark.parametrize(
    "spec,count,name,bf16",
    [
        ("V100-32GB", 1, "Tesla V100-SXM2-32GB", False),
        ("A100-80GBx4", 4, "NVIDIA A100-SXM4-80GB", True),
        ("4xT4", 4, "Tesla T4", False),
        ("h200", 1, "NVIDIA H200", True),
        ("RTX4090", 1, "NVIDIA GeForce RTX 4090", True),
    ],
)
def test_catalog(spec, count, name, bf16):
    hw = catalog_hardware(spec)
    assert hw.gpu_count == count and hw.gpus[0].name == name and hw.bf16 is bf16


def test_catalog_none_and_unknown():
    assert catalog_hardware("none").gpus == ()
    with pytest.raises(HardwareError, match="not in the catalog"):
        catalog_hardware("B300")
    with pytest.raises(HardwareError, match="ambiguous"):
        catalog_hardware("A100")
    # An ambiguous name lists only the cards it could mean, not the whole catalog.
    with pytest.raises(HardwareError) as info:
        catalog_hardware("V100x2")
    text = f"{info.value.message} {info.value.hint}"
    assert "V100-16GB" in text and "V100-32GB" in text and "H100" not in text and "T4" not in text
    assert "V100-16GBx2" in info.value.hint


def test_hardware_file_round_trip(tmp_path):
    hw = catalog_hardware("A10G")
    p = tmp_path / "hw.json"
    p.write_text(json.dumps(hw.to_dict()))
    back = load_hardware_file(p)
    assert back.gpus == hw.gpus
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(HardwareError, match="not valid JSON"):
        load_hardware_file(tmp_path / "bad.json")
    (tmp_path / "bad2.json").write_text(json.dumps({"gpus": [{"name": "x"}]}))
    with pytest.raises(HardwareError, match="malformed"):
        load_hardware_file(tmp_path / "bad2.json")
    assert Hardware().world_size == 1


def test_gpu_memory_of_sums_the_runs_processes():
    from ftlaunch.probe.usage import gpu_memory_of

    class Nv(FakeNvml):
        def nvmlDeviceGetComputeRunningProcesses(self, h):
            ours = SimpleNamespace(pid=100 + h, usedGpuMemory=2 * 2**30)
            return [ours, SimpleNamespace(pid=999, usedGpuMemory=2**30)]

    assert gpu_memory_of({100, 101}, nvml_loader=Nv) == 4.0
    assert gpu_memory_of({100}, nvml_loader=lambda: FakeNvml(fail=True)) is None
