"""A bounded rendezvous check, run on every node of a multi-node job before the trainer
(`srun ... python -m ftlaunch.run.slurm.rendezvous --timeout S`, from srun-trainer.sh).

torchrun's static rendezvous retries a MASTER_ADDR it cannot reach for as long as it is left to:
a job whose nodes cannot reach each other would read as `running` forever. Here node 0 listens on
MASTER_PORT, every other node connects to MASTER_ADDR:MASTER_PORT and says its rank, and node 0
answers once all NNODES have checked in. Plain sockets, no torch: it takes well under a second when
the network is right. Not done within the timeout: each node prints one line starting with
``ftlaunch: rendezvous failed:`` (what the supervisor classifies as a `rendezvous` failure) and exits 75.

The listener closes only after every client has closed (so the port is never left in TIME_WAIT on
node 0, where torchrun binds it next), with SO_REUSEADDR in any case.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Mapping

FAILED = "ftlaunch: rendezvous failed:"
EXIT_FAILED = 75  # EX_TEMPFAIL


def _serve(port: int, nodes: int, deadline: float) -> None:
    dual = socket.has_dualstack_ipv6()
    family = socket.AF_INET6 if dual else socket.AF_INET
    with socket.create_server(("", port), family=family, dualstack_ipv6=dual) as srv:
        srv.settimeout(0.5)
        clients: list[socket.socket] = []
        try:
            while len(clients) < nodes - 1:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(clients) + 1} of {nodes} nodes checked in at port {port}")
                try:
                    conn, _ = srv.accept()
                except TimeoutError:
                    continue
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                if conn.recv(64).startswith(b"rank "):
                    clients.append(conn)
                else:
                    conn.close()
            for c in clients:
                c.sendall(b"go\n")
            for c in clients:  # wait for the client's close: the TIME_WAIT stays on its side
                c.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    c.recv(8)
                except OSError:
                    pass
        finally:
            for c in clients:
                c.close()


def _join(addr: str, port: int, rank: int, deadline: float) -> None:
    last: str = "never tried"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))) as c:
                c.sendall(f"rank {rank}\n".encode())
                c.settimeout(max(0.1, deadline - time.monotonic()))
                if c.recv(8).startswith(b"go"):
                    return
                last = "node 0 closed the connection before all nodes checked in"
        except OSError as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.5)
    raise TimeoutError(f"node {rank} could not reach node 0 at {addr}:{port}: {last}")


def check(env: Mapping[str, str], timeout: float) -> str | None:
    """None when every node checked in within ``timeout`` seconds; else why not."""
    try:
        nodes = int(env.get("NNODES") or env.get("SLURM_NNODES") or 1)
        rank = int(env.get("SLURM_NODEID") or env.get("NODE_RANK") or 0)
        addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError) as exc:
        return f"MASTER_ADDR, MASTER_PORT, NNODES or SLURM_NODEID missing or wrong ({exc})"
    if nodes <= 1:
        return None
    deadline = time.monotonic() + timeout
    try:
        socket.getaddrinfo(addr, port)
    except OSError as exc:
        return f"MASTER_ADDR {addr} does not resolve on node {rank} ({exc}); pass --master-addr"
    try:
        if rank == 0:
            _serve(port, nodes, deadline)
        else:
            _join(addr, port, rank, deadline)
    except OSError as exc:  # TimeoutError included
        return f"not complete within {timeout:g} s: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ftlaunch.run.slurm.rendezvous")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    env = dict(os.environ)
    why = check(env, args.timeout)
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    if why is not None:
        print(f"{FAILED} {why} (on {node}; MASTER_ADDR={env.get('MASTER_ADDR')} MASTER_PORT={env.get('MASTER_PORT')})",
              flush=True)  # fmt: skip
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
