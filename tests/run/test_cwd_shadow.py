"""Issue 40 item 2: a folder named ``ftlaunch`` in the folder a child starts in (a clone's parent, a home
holding the clone) never stands in for the package. ``python -m`` puts the working folder first on
sys.path; every Python child ftlaunch starts has ``-P`` (run/procs.python_module), which leaves it out.

- every command line ftlaunch builds for a Python child has -P before its -m or -c (the source's list
  literals, the Ray entrypoint, the Slurm batch script and wrapper, the Slurm step's child, the cron
  line and systemd unit, the local supervisor);
- a detached run started from such a folder runs its crash retry and ends succeeded;
- a Slurm job (tests/slurm/fakeslurm.py runs the batch script in the submitting folder, as Slurm does)
  started from such a folder runs, is requeued, and its second start (`python -P -m ftlaunch resume`)
  imports the real package and finishes the run;
- the Ray lane: tests/ray_engine/test_ray_shadow.py.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ftlaunch.run.procs import python_module

from ..conftest import ROOT, venv_bin
from ..helpers import wait_for
from .test_e2e_slurm import cluster as cluster  # the Slurm stand-ins' fixture (tests/slurm/fakeslurm.py)
from .test_races import setup

PKG = ROOT / "ftlaunch"


def shadow_folder(root: Path) -> Path:
    """A folder holding ``ftlaunch/`` whose import fails loudly: it shadows any install (an empty one
    shadows an editable install only, as a namespace package)."""
    cwd = root / "cwd"
    (cwd / "ftlaunch").mkdir(parents=True)
    (cwd / "ftlaunch" / "__init__.py").write_text('raise ImportError("the ftlaunch folder of the cwd was imported")\n')
    return cwd


def test_the_shadow_is_real_without_P_and_gone_with_it(tmp_path):
    """The fault the tests below guard against, shown on this install: plain -m imports the folder."""
    cwd = shadow_folder(tmp_path)
    plain = subprocess.run([sys.executable, "-m", "ftlaunch", "--version"], cwd=cwd, capture_output=True, text=True)
    assert plain.returncode != 0 and "the ftlaunch folder of the cwd was imported" in plain.stderr
    argv = python_module(sys.executable, "ftlaunch", "--version")
    fixed = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert fixed.returncode == 0 and "ftlaunch, version" in fixed.stdout, fixed.stderr
    # the clone's parent as the issue met it: an empty folder shadows an editable install
    empty = tmp_path / "parent"
    (empty / "ftlaunch").mkdir(parents=True)
    assert subprocess.run(argv, cwd=empty, capture_output=True, timeout=60).returncode == 0


def _python_lists(tree: ast.AST) -> list[ast.List | ast.Tuple]:
    """List and tuple literals that run Python (a ``-m`` or ``-c`` word, not after a shell's name),
    but for those a call starts in a folder it names (``cwd=``): a Python that may predate -P (the
    trainer's) is kept from the caller's folder that way."""
    placed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and any(k.arg == "cwd" for k in node.keywords) and node.args:
            placed.add(id(node.args[0]))
    named: dict[str, list[ast.expr]] = {}  # cmd = [...]; run(cmd, cwd=...): the lists a name holds
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            named.setdefault(node.targets[0].id, []).append(node.value)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and any(k.arg == "cwd" for k in node.keywords) and node.args:
            if isinstance(node.args[0], ast.Name):
                placed.update(id(v) for v in named.get(node.args[0].id, []))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.List | ast.Tuple) or id(node) in placed:
            continue
        words = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
        head = words[0] if words else None
        if isinstance(head, str) and "python" not in head:
            continue  # ["/bin/sh", "-c", ...], ["git", "-c", ...]: not Python
        if "-m" in words or "-c" in words:
            found.append(node)
    return found


def test_every_python_child_in_the_source_has_P_before_its_m_or_c():
    missing = []
    for path in sorted(PKG.rglob("*.py")):
        for node in _python_lists(ast.parse(path.read_text())):
            words = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            first = min(words.index(w) for w in ("-m", "-c") if w in words)
            if "-P" not in words[:first]:
                missing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not missing, f"a Python child without -P (use ftlaunch.run.procs.python_module) or a cwd: {missing}"


def test_the_checker_finds_a_child_without_P_and_passes_one_placed_by_cwd():
    bad = "subprocess.run([sys.executable, '-m', 'ftlaunch.run.notify', d])"
    assert len(_python_lists(ast.parse(bad))) == 1
    good = "subprocess.run([sys.executable, '-P', '-m', 'x'])\ncmd = [py, '-c', CODE]\nsubprocess.run(cmd, cwd=tmp)"
    assert [n for n in _python_lists(ast.parse(good)) if "-P" not in [getattr(e, "value", 0) for e in n.elts]] == []
    assert _python_lists(ast.parse("subprocess.run(['/bin/sh', '-c', target])")) == []


def test_the_engines_command_lines_have_P(tmp_path):
    from ftlaunch.run.engines.local import supervisor_command
    from ftlaunch.run.ray.submit import entrypoint
    from ftlaunch.run.slurm.job import child_command
    from ftlaunch.run.slurm.sbatch import SlurmRequest, render_job
    from ftlaunch.schedule.cron import parse_cron
    from ftlaunch.schedule.crontab import cron_line
    from ftlaunch.schedule.units import run_argv, systemd_units

    run = tmp_path / "20260101-000000-abcd"
    run.mkdir()
    (run / "events.jsonl").write_text("")
    assert entrypoint(run, "/v/bin/python", True) == f"exec /v/bin/python -P -m ftlaunch.run.supervisor {run}"
    assert entrypoint(run, "/v/bin/python", False) == (
        f"exec /v/bin/python -P -m ftlaunch resume {run.name} --foreground --no-follow"
    )
    assert child_command(run, "/v/bin/python")[:3] == ["/v/bin/python", "-P", "-m"]
    assert supervisor_command(run)[1:4] == ["-P", "-m", "ftlaunch.run.supervisor"]
    files = render_job(run, run.name, "n", SlurmRequest(nodes=2, gpus_per_node=8), "/v/bin/python", ["t"], {})
    assert files.script.rstrip().endswith(f"exec /v/bin/python -P -m ftlaunch.run.slurm.job {run}")
    assert "/v/bin/python -P -m ftlaunch.run.slurm.rendezvous --timeout" in files.trainer
    argv = run_argv("nightly", "/v/bin/python")
    assert argv == ["/v/bin/python", "-P", "-m", "ftlaunch", "schedule", "run", "nightly"]
    cron = parse_cron("0 2 * * *")
    line = cron_line(cron, "nightly", argv, {}, Path("/h/n.log"))
    assert "/v/bin/python -P -m ftlaunch schedule run nightly >>" in line  # readable, one word more
    service = systemd_units(cron, "nightly", argv, {}, Path("/h/n.log"))["ftlaunch-nightly.service"]
    assert "ExecStart=/v/bin/python -P -m ftlaunch schedule run nightly" in service


def _ftl(cwd: Path, env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv_bin() / "ftlaunch"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _status(cwd: Path, env: dict, run_id: str) -> dict:
    return json.loads(_ftl(cwd, env, "status", run_id, "--json").stdout)


@pytest.mark.e2e
def test_a_detached_run_started_from_a_shadowed_folder_retries_and_succeeds(tmp_path):
    cwd = shadow_folder(tmp_path)
    cfg, env = setup(tmp_path, [{"crash": "boom"}, {"ok": True, "steps": 4}])
    r = _ftl(cwd, env, "train", str(cfg), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    run = json.loads(r.stdout)
    done = wait_for(
        lambda: (s := _status(cwd, env, run["id"]))["status"] in ("succeeded", "failed", "lost") and s,
        "the run's end",
        timeout=180,
    )
    log = (Path(run["run_dir"]) / "supervisor.log").read_text()
    assert done["status"] == "succeeded", (done, log)
    assert (tmp_path / "counter").read_text() == "2"  # the crash retry ran: two attempts
    assert "the ftlaunch folder of the cwd was imported" not in log


@pytest.mark.e2e
def test_a_slurm_job_from_a_shadowed_folder_is_requeued_and_resumes_with_the_real_package(tmp_path, cluster):
    """The batch script runs in the submitting folder (Slurm's default, the stand-in's too): its step,
    the supervisor it starts, and the requeued start's `resume` all import the real package."""
    cwd = shadow_folder(tmp_path)
    env = cluster["env"]
    env["FAKE_SLURM_SIGNAL_WHEN"] = str(cluster["out"] / "checkpoint-10")
    env["FAKE_STEP_SECONDS"] = "0.2"
    r = _ftl(
        cwd, env, "train", str(cluster["config"]), "--slurm", "--nodes", "2", "--gpu", "A100-80GBx8",
        "--source-gpus", "16", "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    run = json.loads(r.stdout)
    run_dir = Path(run["run_dir"])
    done = wait_for(
        lambda: (s := _status(cwd, env, run["id"]))["status"] in ("succeeded", "failed", "lost", "stopped") and s,
        "the Slurm run's end",
        timeout=240,
    )
    log = (run_dir / "train.log").read_text()
    assert done["status"] == "succeeded", (done, log[-3000:])
    assert "the ftlaunch folder of the cwd was imported" not in log
    kinds = [json.loads(x)["event"] for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    assert "requeued" in kinds and kinds.count("slurm_job_started") == 2, kinds  # the second start ran
    assert kinds.count("resumed") >= 1 or kinds.count("attempt_started") >= 2, kinds
