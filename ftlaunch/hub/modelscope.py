"""ModelScope downloads, in a child process (the modelscope package is optional)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

from ..errors import HubError, NetworkError
from .endpoints import MODELSCOPE
from .results import DownloadResult

_MODELSCOPE_CHILD = """
import json, sys
args = json.loads(sys.argv[1])
from modelscope import snapshot_download
print("FTLAUNCH_PATH=" + snapshot_download(args["repo_id"], revision=args["revision"], cache_dir=args["cache_dir"]))
"""


def _download_modelscope(
    repo_id: str, *, revision: str | None, cache_dir: str | Path | None, started: float
) -> DownloadResult:
    """Delegate to ``modelscope.snapshot_download`` in a child process: importing modelscope imports torch,
    which ftlaunch's own process never does."""
    if importlib.util.find_spec("modelscope") is None:
        raise HubError(
            "ModelScope was chosen as the download source but the 'modelscope' package is not installed",
            hint="pip install modelscope, or choose another mirror (--mirror hf-mirror / hf)",
        )
    args = {"repo_id": repo_id, "revision": revision, "cache_dir": str(cache_dir) if cache_dir else None}
    proc = subprocess.run(
        [sys.executable, "-P", "-c", _MODELSCOPE_CHILD, json.dumps(args)],  # -P: the cwd shadows no package
        stdout=subprocess.PIPE,  # stderr is inherited: modelscope's progress and errors reach the user directly
        text=True,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FTLAUNCH_PATH=")]
    if proc.returncode != 0 or not lines:
        raise NetworkError(
            f"ModelScope download of {repo_id} failed (exit {proc.returncode}); its output is above",
            hint="check the model id on modelscope.cn, or choose another mirror (--mirror hf-mirror / hf)",
        )
    path = Path(lines[-1].split("=", 1)[1])
    files = [p for p in path.rglob("*") if p.is_file()]
    return DownloadResult(
        repo_id=repo_id,
        path=str(path),
        endpoint=MODELSCOPE,
        revision=revision,
        files=len(files),
        bytes=sum(p.stat().st_size for p in files),
        retries=0,
        seconds=round(time.monotonic() - started, 3),
    )
