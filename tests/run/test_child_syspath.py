"""The children run by path (`TRAINER_PYTHON child.py ...`) take their own folder off sys.path before
anything imports: Python puts it first, and ftlaunch/run/ray was then the top-level `ray`
(transformers' is_ray_tune_available found it). Each child is run by path, as ftlaunch runs it, with a
sitecustomize whose exit hook reports what its sys.path and `ray` were at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHILDREN = ["ftlaunch/run/preflight_child.py", "ftlaunch/run/weights_child.py", "ftlaunch/estimate/count_child.py"]

HOOK = """
import atexit, importlib.util, json, os, sys
def _report():
    spec = importlib.util.find_spec("ray")
    with open(os.environ["REPORT"], "w") as f:
        json.dump({"path": [os.path.realpath(p or os.curdir) for p in sys.path],
                   "ray": spec.origin if spec else None}, f)
atexit.register(_report)
"""


@pytest.mark.parametrize("child", CHILDREN)
def test_a_child_run_by_path_takes_its_folder_off_sys_path(child, tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(HOOK)
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "REPORT": str(report)}
    # No arguments: the child fails on its argv, after its top level ran; the hook reports at exit.
    subprocess.run([sys.executable, str(ROOT / child)], env=env, capture_output=True, timeout=120, cwd=tmp_path)
    got = json.loads(report.read_text())
    folder = os.path.realpath(ROOT / child).rsplit(os.sep, 1)[0]
    assert folder not in got["path"], got["path"]
    assert got["ray"] is None or not got["ray"].startswith(str(ROOT / "ftlaunch")), got["ray"]
