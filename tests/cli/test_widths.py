"""Every table at 60, 80, 100 and 120 columns and piped (issue 24), read back from the rendered text:
keys, ids, numbers and progress whole on one line, paths re-joined from lines broken only after a
`/`, no ellipsis, no line wider than the width.

The commands run in-process (CliRunner) as a terminal of N columns would see them (ftlaunch's
console asks rich for the width, rich reads COLUMNS) or piped (PIPE_WIDTH); the estimate tables
render a real `estimate --json` (tests/data/tables) through the functions the command calls. One
test runs the real binary in a pseudo-terminal of 80 columns.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from rich.console import Console

from ftlaunch.cli.main import main
from ftlaunch.present.render import PIPE_WIDTH
from ftlaunch.present.tables import Cell, Col, Grid, narrowest, wrap

from ..conftest import ROOT, venv_bin
from ..schedule.test_schedule import fake_trainer  # noqa: F401 (fixture)

WIDTHS = (60, 80, 100, 120, None)  # None: piped
TABLES = ROOT / "tests" / "data" / "tables"
LONG_OUT = "/data/x/saves/qwen2.5-7b/lora/sft-long-name"
RUN_IDS = ("20261201-131301-89ab", "20261201-131302-cdef", "20261201-131303-0f1e")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


# ---------------------------------------------------------------- reading the text back


def pieces_at(lines: list[str], i: int, col: int) -> str:
    """The run of non-blank characters starting at ``col`` on line ``i`` ("" past its end)."""
    return lines[i][col:].split(" ", 1)[0] if i < len(lines) else ""


def fits(rest: str, piece: str) -> bool:
    """Whether the path segment that ``piece`` breaks inside would have fitted on a line of its own
    (so the break belonged after its `/`); a segment longer than the line must fold (a long TMPDIR)."""
    segment = rest[piece.rfind("/") + 1 :].split("/", 1)[0]
    return len(segment) <= len(piece)


def rejoins(text: str, path: str) -> bool:
    """``path`` is on one line, or starts a cell and goes on at the same column on the lines
    below, every line but the last ending in `/` (or folding a segment longer than its line)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        for m in re.finditer(r"(?:(?<= )|^)/", line):
            col, rest, j = m.start(), path, i
            while rest:
                piece = pieces_at(lines, j, col)
                if (
                    not piece
                    or not rest.startswith(piece)
                    or (piece != rest and not piece.endswith("/") and fits(rest, piece))
                ):
                    break
                rest, j = rest[len(piece) :], j + 1
            if not rest:
                return True
    return False


def check(text: str, width: int | None, words: Iterable[str], paths: Iterable[str] = ()) -> None:
    lines = text.splitlines()
    assert lines, "nothing printed"
    assert "…" not in text, text
    wide = [line for line in lines if len(line.rstrip()) > (width or PIPE_WIDTH)]
    assert not wide, f"wider than {width or PIPE_WIDTH}: {wide}"
    for w in words:
        assert any(w in line for line in lines), f"{w!r} is not whole on one line at width {width}:\n{text}"
    for p in paths:
        assert rejoins(text, p), f"{p!r} does not re-join at width {width}:\n{text}"


def as_terminal(monkeypatch: pytest.MonkeyPatch, width: int | None) -> None:
    """A terminal ``width`` columns wide (rich reads COLUMNS), or a pipe."""
    if width is None:
        monkeypatch.setattr("ftlaunch.cli.render._isatty", lambda stream: False)
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setattr("ftlaunch.cli.render._isatty", lambda stream: True)
        monkeypatch.setenv("COLUMNS", str(width))


def cli(monkeypatch: pytest.MonkeyPatch, width: int | None, *args: str, stderr: bool = False) -> str:
    with monkeypatch.context() as m:
        as_terminal(m, width)
        r = CliRunner().invoke(main, list(args))
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output
    return r.stderr if stderr else r.stdout


def rendered(renderables: Iterable, width: int | None) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=width or PIPE_WIDTH, no_color=True)
    for r in renderables:
        console.print(r)
    return buf.getvalue()


# ---------------------------------------------------------------- the rule itself


def test_wrap_breaks_each_kind_only_where_it_may():
    assert wrap("/data/x/saves/base", "path", 8) == ["/data/x/", "saves/", "base"]
    assert wrap("849/6400", "word", 4) == ["849/", "6400"]  # only when one word is wider than all there is
    assert wrap("keeps global batch 64", "prose", 12) == ["keeps global", "batch 64"]
    assert wrap("see /a/b/c/dd", "prose", 7) == ["see", "/a/b/c/", "dd"]  # a path in prose folds at a slash
    assert narrowest("/data/x/saves/qwen2.5-7b", "path") == len("qwen2.5-7b")
    assert narrowest("849/6400 (13%)", "word") == len("849/6400 (13%)")


def test_a_table_that_cannot_fit_is_stacked_never_cut():
    t = Grid(Col("key"), Col("after", "path"), Col("why", "prose"), title="t")
    t.add_row("gradient_accumulation_steps", Cell("8", "word"), "keeps the global batch")
    assert t.widths(120) is not None and t.widths(30) is None
    narrow = rendered([t], 30)
    # the key is wider than the room beside its label: it goes whole on the line below
    assert "key:\n  gradient_accumulation_steps\nafter: 8\nwhy:   keeps the global batch" in narrow, narrow
    assert "gradient_accumulation_steps  8" in rendered([t], 120)
    check(narrow, 30, ["gradient_accumulation_steps"])


# ---------------------------------------------------------------- every table


def write_config(tmp_path: Path) -> tuple[Path, Path]:
    """A config with long paths: a dataset folder, a DeepSpeed file, output_dir."""
    data = tmp_path / "data" / "x" / "datasets" / "alpaca-long-name"
    data.mkdir(parents=True)
    (data / "dataset_info.json").write_text(json.dumps({"tiny": {"file_name": "tiny.json"}}))
    (data / "tiny.json").write_text(json.dumps([{"instruction": "hi", "input": "", "output": "hello"}]))
    ds = tmp_path / "configs" / "deepspeed" / "ds_z3_offload_config.json"
    ds.parent.mkdir(parents=True)
    shutil.copy(ROOT / "ftlaunch" / "data" / "ds_z3_offload_config.json", ds)
    cfg = {
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "lora",
        "dataset": "tiny",
        "dataset_dir": str(data),
        "output_dir": str(tmp_path / "saves" / "qwen2.5-7b" / "lora" / "sft-long-name"),
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "overwrite_output_dir": True,
        "deepspeed": str(ds),
        "bf16": True,
    }
    path = tmp_path / "configs" / "qwen2.5-7b-lora-sft-long-name.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, ds


def test_plan_at_every_width(tmp_path, monkeypatch):
    cfg, ds = write_config(tmp_path)
    args = ("plan", str(cfg), "--gpu", "V100-32GB", "--source-gpus", "8", "--params", "7B")
    d = json.loads(cli(monkeypatch, None, *args, "--json"))
    keys = [c["key"] for c in d["changes"]]
    assert {"gradient_accumulation_steps", "overwrite_output_dir", "deepspeed", "bf16", "fp16"} <= set(keys)
    shown = {"<removed>": "(removed)", "True": "true", "False": "false", "None": "-"}
    values = [shown.get(str(v), str(v)) for c in d["changes"] for v in (c["old"], c["new"]) if "/" not in str(v)]
    values += [f"{b}:{p:.1f}" for b, p in d["memory"]["tried"]]  # micro-batch:peak pairs
    memory = [f"{d['memory'][k]:.2f}" for k in ("weights_gib", "peak_gib", "capacity_gib")]
    for width in WIDTHS:
        text = cli(monkeypatch, width, *args)
        batch = f"{d['global_batch']['source']} -> {d['global_batch']['target']}"
        check(text, width, [*keys, *values, *memory, batch], [str(ds)])


def test_what_would_fit_at_every_width(tmp_path, monkeypatch):
    cfg, _ = write_config(tmp_path)
    args = ("plan", str(cfg), "finetuning_type=full", "--gpu", "T4", "--params", "7B")
    d = json.loads(cli(monkeypatch, None, *args, "--json"))
    assert d["error"] and d["alternatives"], d
    words = ["same numbers:", "other method/data:"]
    for a in d["alternatives"]:
        words += [a["option"], f"{a['peak_gib']:.1f}"]
        words += [f"{k}={v}" for k, v in (a.get("change") or {}).items()] if a.get("fits") else []
    for width in WIDTHS:
        check(cli(monkeypatch, width, *args, stderr=True), width, words)


def write_run(home: Path, run_id: str, name: str, status: str, step: int, total: int) -> Path:
    from ftlaunch.run.state import RunState, RunStatus
    from ftlaunch.run.store import write_state

    run_dir = home / "runs" / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "source.yaml").write_text("stage: sft\n")
    state = RunState(
        id=run_id,
        name=name,
        status=RunStatus(status),
        created="2026-12-01T13:13:01+00:00",
        attempt=2,
        output_dir=LONG_OUT,
        run_dir=str(run_dir),
        gpu_model="NVIDIA A100-SXM4-80GB",
        gpu_count=1,
        micro_batch=4,
        accumulation=16,
        progress={"step": step, "total_steps": total, "loss": 1.2345},
        last_checkpoint=800,
        message="stopped by the user (SIGTERM) at step 849 of 6400; resume with ftlaunch resume",
    )
    write_state(run_dir, state)
    time.sleep(0.01)  # creation order by source.yaml's mtime
    return run_dir


def test_runs_and_status_at_every_width(isolated_home, monkeypatch):
    names = ("qwen2.5-7b-lora-sft-long-name", "nightly", "sft")
    dirs = [
        write_run(isolated_home, i, n, s, step, 6400)
        for i, n, s, step in zip(RUN_IDS, names, ("stopped", "succeeded", "failed"), (849, 6400, 12), strict=True)
    ]
    for width in WIDTHS:
        text = cli(monkeypatch, width, "runs")
        check(text, width, [*RUN_IDS, *names, "849/6400", "6400/6400", "12/6400", "1.2345", "12-01 13:13"], [LONG_OUT])
        text = cli(monkeypatch, width, "status", RUN_IDS[0])
        words = [RUN_IDS[0], "849/6400 (13%)", "1.234", "800", "SIGTERM", "ftlaunch"]  # loss to 4 digits
        check(text, width, words, [LONG_OUT, str(dirs[0])])


def test_estimate_one_machine_at_every_width():
    from ftlaunch.cli.estimate import estimate_renderables

    out = json.loads((TABLES / "estimate-one.json").read_text())
    mem = out["memory"]
    words = [
        f"{out['samples']:,}",
        f"{out['total_tokens']:,}",
        f"{out['optimizer_steps']:,}",
        f"{out['gpu_hours'][0]:.2f} - {out['gpu_hours'][1]:.2f}",
        *(f"{mem[k]:.2f}" for k in ("weights_gib", "peak_gib", "usable_gib")),
        "disable_gradient_checkpointing",
        "adamw_torch_fused",
        "--probe-steps",
    ]
    for width in WIDTHS:
        check(rendered(estimate_renderables(out), width), width, words, [out["histogram"]])


def test_estimate_compare_at_every_width():
    from ftlaunch.cli.estimate import comparison_renderables

    out = json.loads((TABLES / "estimate-compare.json").read_text())
    words = []
    for m in out["machines"]:
        gh, cost = m["gpu_hours"], m["cost"]
        words += [m["machine"], f"{gh[0]:.2f}-{gh[1]:.2f}", f"{m['micro_batch']} x {m['accumulation']}"]
        words += [f"{m['tokens_per_second']:,.0f}"] + ([f"{cost[0]:,.2f}-{cost[1]:,.2f}"] if cost else [])
    for width in WIDTHS:
        text = rendered(comparison_renderables(out), width)
        check(text, width, words)
        if width and width >= 80:  # eight columns of words fit at 80: still a grid
            assert any(line.split()[:2] == ["machine", "fits"] for line in text.splitlines()), text


def test_schedule_list_at_every_width(tmp_path, monkeypatch, fake_trainer):  # noqa: F811
    cfg, _ = write_config(tmp_path)
    name = "nightly-qwen2.5-7b-lora-sft"
    add = ("schedule", "add", name, str(cfg), "--cron", "0 2 * * *", "--gpu", "A10G", "--print")
    assert CliRunner().invoke(main, list(add)).exit_code == 0
    r = CliRunner().invoke(main, ["schedule", "run", name])
    assert r.exit_code == 0, r.output
    (view,) = json.loads(CliRunner().invoke(main, ["schedule", "list", "--json"]).stdout)
    words = [name, "0 2 * * *", view["run_id"], "succeeded", view["next"][:16].replace("T", " ")]
    for width in WIDTHS:
        check(cli(monkeypatch, width, "schedule", "list"), width, words, [str(cfg)])


def test_env_at_every_width(tmp_path, monkeypatch):
    from ftlaunch.plan.hardware import parse_nvidia_smi_csv

    csv = ROOT / "tests" / "data" / "nvidia-smi-4xa100.csv"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"  # the captured output of a 4x A100 machine, printed by a stand-in
    smi.write_text(f"#!/bin/sh\ncat {csv}\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    gpus, driver = parse_nvidia_smi_csv(csv.read_text())
    hw = json.loads(cli(monkeypatch, None, "env", "--json"))
    assert hw["source"] == "nvidia-smi", hw
    versions = [v for v in hw["versions"].values() if v]
    words = [driver or "", *(g.name for g in gpus), *(f"{g.total_gib:.1f}" for g in gpus), *versions]
    for width in WIDTHS:
        check(cli(monkeypatch, width, "env"), width, words)


def test_runs_in_a_real_terminal_of_80_columns(isolated_home):
    """The real binary on a pseudo-terminal 80 columns wide: the width comes from the terminal."""
    import fcntl
    import pty
    import struct
    import termios

    write_run(isolated_home, RUN_IDS[0], "qwen2.5-7b-lora-sft-long-name", "stopped", 849, 6400)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    p = subprocess.Popen([str(venv_bin() / "ftlaunch"), "runs"], stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert p.wait(timeout=60) == 0
    text = ANSI.sub("", b"".join(chunks).decode()).replace("\r\n", "\n")
    check(text, 80, [RUN_IDS[0], "qwen2.5-7b-lora-sft-long-name", "849/6400", "1.2345"], [LONG_OUT])
