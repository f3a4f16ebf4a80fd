"""Clean restarts (issue 20): before the next attempt, wait until the old trainer's processes are gone
from NVML and the memory in use is back near the start figure, bounded. Scripted probes and a fake
clock: no GPU is touched."""

from __future__ import annotations

from types import SimpleNamespace

from ftlaunch.run.gpuwait import GpuWait, gpu_pids_gone, gpu_used_mib, nvml_probes, wait_gpu_released

MIB = 2**20


class Clock:
    """A clock that moves only when slept on; records the sleeps."""

    def __init__(self) -> None:
        self.t = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


def scripted(*values):
    """A probe answering these values in turn, the last one forever; counts its calls."""
    seen = list(values)

    def probe():
        probe.calls += 1
        return seen.pop(0) if len(seen) > 1 else seen[0]

    probe.calls = 0
    return probe


def test_released_after_three_polls_says_how_long_it_waited():
    clock = Clock()
    used = scripted(30_000.0, 12_000.0, 4_000.0, 900.0)  # the driver frees the memory over 3 s
    gone = scripted(False, True)
    w = wait_gpu_released(gone, used, 600.0, clock=clock, sleep=clock.sleep)
    assert w == GpuWait(3.0, True, 900.0, 600.0, 512.0)
    assert clock.sleeps == [1.0, 1.0, 1.0] and used.calls == 4
    assert w.message == "GPU released after 3.0 s (900 MiB in use, 600 MiB before the first attempt)"


def test_the_processes_are_waited_for_even_when_the_memory_is_back():
    clock = Clock()
    gone = scripted(False, False, True)
    w = wait_gpu_released(gone, scripted(700.0), 600.0, clock=clock, sleep=clock.sleep)
    assert w.released and w.waited_s == 2.0 and gone.calls == 3


def test_never_released_is_bounded_and_says_so():
    clock = Clock()
    w = wait_gpu_released(scripted(False), scripted(30_000.0), 600.0, bound_s=50.0, clock=clock, sleep=clock.sleep)
    assert not w.released and w.waited_s == 50.0 and w.used_mib == 30_000.0 and not w.pids_gone
    assert sum(clock.sleeps) == 50.0 and len(clock.sleeps) == 50
    assert w.message == (
        "GPU not released after 50.0 s: the old trainer's processes still hold GPU memory; "
        "30000 MiB in use, more than 1112 (512 above the start)"
    )


def test_the_bound_is_kept_with_a_poll_that_does_not_divide_it():
    clock = Clock()
    w = wait_gpu_released(
        scripted(True), scripted(9_000.0), 0.0, bound_s=2.5, poll_s=1.0, clock=clock, sleep=clock.sleep
    )
    assert clock.sleeps == [1.0, 1.0, 0.5] and w.waited_s == 2.5 and not w.released
    assert w.message == "GPU not released after 2.5 s: 9000 MiB in use, more than 512 (512 above the start)"


def test_no_gpu_means_no_wait():
    clock = Clock()
    gone = scripted(False)
    w = wait_gpu_released(gone, scripted(None), 600.0, clock=clock, sleep=clock.sleep)
    assert w.skipped and w.released and w.waited_s == 0.0 and w.used_mib is None
    assert clock.sleeps == [] and gone.calls == 0
    assert "not held back" in w.message


def test_without_a_start_figure_only_the_processes_are_waited_for():
    clock = Clock()
    w = wait_gpu_released(scripted(False, True), scripted(50_000.0), None, clock=clock, sleep=clock.sleep)
    assert w.released and w.waited_s == 1.0


def test_nvml_going_away_mid_wait_ends_at_the_bound_and_says_so():
    clock = Clock()
    w = wait_gpu_released(scripted(True), scripted(9_000.0, None), 0.0, bound_s=3, clock=clock, sleep=clock.sleep)
    assert not w.released and w.used_mib is None and "? MiB in use" in w.message


class FakeNvml:
    """pynvml as it answers: two 80 GiB GPUs, ``used`` MiB in use on each, processes per GPU."""

    def __init__(self, used: list[int], procs: list[list[tuple[int, int]]], fail: bool = False):
        self.used, self.procs, self.fail = used, procs, fail

    def nvmlInit(self):
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self): ...

    def nvmlSystemGetDriverVersion(self):
        return "550.54.15"

    def nvmlDeviceGetCount(self):
        return len(self.used)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetMemoryInfo(self, h):
        total = 81559 * MIB
        return SimpleNamespace(total=total, free=total - self.used[h] * MIB, used=self.used[h] * MIB)

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return (9, 0)

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}"

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=pid, usedGpuMemory=mib * MIB) for pid, mib in self.procs[h]]


def test_the_nvml_probes_count_the_visible_gpus_and_the_old_processes():
    nv = FakeNvml([1200, 30_000], [[], [(4242, 29_000), (77, 500)]])
    load = lambda: nv  # noqa: E731
    assert gpu_used_mib(None, load) == 31_200.0
    assert gpu_used_mib("0", load) == 1200.0  # the trainer's GPUs only: another job's memory does not count
    assert gpu_used_mib("", load) is None  # none visible: nothing to wait for
    assert not gpu_pids_gone({4242, 4243}, load) and gpu_pids_gone({5000}, load)
    gone, used = nvml_probes({4242}, "1", load)
    assert (gone(), used()) == (False, 30_000.0)
    nv.used, nv.procs = [1200, 700], [[], []]
    assert (gone(), used()) == (True, 700.0)


def test_no_nvml_gives_none_so_the_wait_is_skipped():
    def load():
        return FakeNvml([], [], fail=True)

    gone, used = nvml_probes({1}, None, load)
    assert used() is None and gone()
    w = wait_gpu_released(gone, used, None, sleep=lambda s: (_ for _ in ()).throw(AssertionError("slept")))
    assert w.skipped and w.waited_s == 0.0
