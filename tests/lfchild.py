"""One Python that imports llamafactory once, forked for each child a test would start (issue 32: the
fast lane under 120 s).

Several tests hold ftlaunch to what the installed LLaMA-Factory itself does, in a child Python
(`python -c CODE ARGS` or `python SCRIPT ARGS`). Importing llamafactory (torch, transformers) costs
about 10 s per child; this server pays it once per test session (per xdist worker) and answers each
`run` from a fresh fork of itself: its own argv, environment, working directory, stdout and stderr,
and exit status, as a new child would have, with the heavy modules already imported.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

# Runs as `python -c SERVER`: imports the common heavy base, then reads one request per line from
# stdin and answers {"rc": n} on a copy of its stdout (stray prints of imports go to stderr).
SERVER = r"""
import json, os, runpy, sys, traceback
reply = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
import llamafactory.hparams  # torch, transformers, llamafactory: the ~10 s every child would pay
reply.write('{"ready": true}\n'); reply.flush()
for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        rc = 0
        try:
            for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
            os.environ.clear(); os.environ.update(req["env"]); os.chdir(req["cwd"])
            argv = req["argv"]
            try:
                if argv[0] == "-c":
                    sys.argv = ["-c", *argv[2:]]; sys.path[0] = ""
                    exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
                else:
                    sys.argv = list(argv); sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                    runpy.run_path(argv[0], run_name="__main__")
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 0 if e.code is None else print(e.code, file=sys.stderr) or 1
            except BaseException:
                traceback.print_exc(); rc = 1
        finally:
            try: sys.stdout.flush(); sys.stderr.flush()
            finally: os._exit(rc)
    _, status = os.waitpid(pid, 0)
    reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n"); reply.flush()
"""


class LlamaFactoryChild:
    """`run(argv, env=..., check=...)` is `subprocess.run([sys.executable, *argv], capture_output=True,
    text=True, ...)` for a Python that imports llamafactory, answered by a fork of one server."""

    def __init__(self, env: dict[str, str], workdir: Path) -> None:
        self._dir = workdir
        self._proc = subprocess.Popen(
            [sys.executable, "-c", SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # its own process group, its forks in it: a timeout ends them all
        )
        ready = self._proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"the llamafactory child server did not start (exit {self._proc.wait()})")
        self._n = 0

    def run(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str | Path | None = None,
        check: bool = False,
        timeout: float = 300,
    ) -> subprocess.CompletedProcess:
        self._n += 1
        out, err = self._dir / f"{self._n}.out", self._dir / f"{self._n}.err"
        req = {"argv": argv, "env": env, "cwd": str(cwd or os.getcwd()), "stdout": str(out), "stderr": str(err)}
        self._proc.stdin.write(json.dumps(req) + "\n")
        self._proc.stdin.flush()
        # one reply line per request, so nothing is left in the reader's buffer for select to miss
        if not select.select([self._proc.stdout], [], [], timeout)[0]:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the llamafactory child server died (exit {self._proc.wait()})")
        rc = json.loads(line)["rc"]
        r = subprocess.CompletedProcess([sys.executable, *argv], rc, out.read_text(), err.read_text())
        if check:
            r.check_returncode()
        return r

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=60)
