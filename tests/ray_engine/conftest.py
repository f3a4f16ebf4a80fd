"""A real Ray head for the Ray lane (marker ``ray``): ``ray start --head`` on 127.0.0.1, every port
free and chosen here, its own --temp-dir; stopped by ending exactly its own processes (those whose
command line names its temp dir, and their descendants), never `ray stop`, which ends every Ray
process of this machine's user. Without the ray extra the tests skip, saying so."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from ..conftest import venv_bin

RAY_MISSING = (
    None
    if importlib.util.find_spec("ray") is not None and (venv_bin() / "ray").exists()
    else "the ray extra is not installed in this venv (pip install -e '.[ray]', or bash scripts/test.sh --ray)"
)
needs_ray = pytest.mark.skipif(RAY_MISSING is not None, reason=RAY_MISSING or "")


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Head:
    address: str  # the dashboard's URL: the Jobs API
    gcs_port: int
    temp_dir: Path
    started_s: float
    env: dict

    def processes(self) -> list[psutil.Process]:
        """This head's processes: those whose command line names its temp dir, and their descendants."""
        roots = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(str(self.temp_dir) in a for a in p.info["cmdline"] or ()):
                    roots.append(p)
            except psutil.Error:
                continue
        found = {p.pid: p for p in roots}
        for p in roots:
            try:
                for c in p.children(recursive=True):
                    found.setdefault(c.pid, c)
            except psutil.Error:
                continue
        return list(found.values())

    def kill(self) -> None:
        """The head's machine lost: SIGKILL to every one of its processes (the job's driver included)."""
        procs = self.processes()
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=10)

    def stop(self) -> None:
        procs = self.processes()
        for p in procs:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
        _gone, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)


def start_head(num_cpus: int = 4) -> Head:
    temp = Path(tempfile.mkdtemp(prefix="ftl-ray-", dir="/tmp"))  # short: Ray's socket paths have a limit
    gcs, dash, client, agent_http, agent_grpc, metrics, runtime_env, node_mgr, obj_mgr, *workers = free_ports(9 + 40)
    env = dict(os.environ)
    # `ftlaunch stop` lets the supervisor stop the trainer gracefully: Ray's default is SIGKILL after 3 s.
    env["RAY_JOB_STOP_WAIT_TIME_S"] = "30"
    env.pop("RAY_ADDRESS", None)
    cmd = [
        str(venv_bin() / "ray"), "start", "--head", f"--num-cpus={num_cpus}", "--node-ip-address=127.0.0.1",
        f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--include-dashboard=true",
        f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime_env}", f"--node-manager-port={node_mgr}",
        f"--object-manager-port={obj_mgr}", f"--worker-port-list={','.join(map(str, workers))}",
        "--object-store-memory=500000000", "--disable-usage-stats", f"--temp-dir={temp}",
    ]  # fmt: skip
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    head = Head(f"http://127.0.0.1:{dash}", gcs, temp, time.monotonic() - t0, env)
    if r.returncode != 0:
        head.stop()
        shutil.rmtree(temp, ignore_errors=True)
        raise RuntimeError(f"ray start failed ({r.returncode}): {r.stdout[-2000:]}{r.stderr[-2000:]}")
    print(f"ray head up in {head.started_s:.1f} s at {head.address}")
    return head


@pytest.fixture(scope="module")
def ray_head():
    if RAY_MISSING:
        pytest.skip(RAY_MISSING)
    head = start_head()
    try:
        yield head
    finally:
        head.stop()
        shutil.rmtree(head.temp_dir, ignore_errors=True)
