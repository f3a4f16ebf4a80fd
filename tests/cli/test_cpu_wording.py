"""A CPU run's words (issue 41): `status` speaks of the time a CPU run has run, never of "GPU-hours so
far 0"; the plan's memory table holds only GiB figures (the optimizer named in its row's label, the
offload row only where states are offloaded, never on a CPU plan)."""

from __future__ import annotations

import io
import json
import re
from dataclasses import replace
from pathlib import Path

from click.testing import CliRunner
from rich.console import Console

from ftlaunch.cli.main import main
from ftlaunch.cli.render import status_table
from ftlaunch.plan.hardware import catalog_hardware
from ftlaunch.plan.memory.adapt import make_memory_chooser
from ftlaunch.plan.modelspec import spec_from_config
from ftlaunch.plan.planner import plan
from ftlaunch.present.render import memory_table
from ftlaunch.run.runview import CostView, RunView
from ftlaunch.run.state import RunState, RunStatus
from ftlaunch.run.store import write_state

MODELS = Path(__file__).resolve().parents[1] / "data" / "corpus" / "model-configs"
SEED = {"model_name_or_path": "Qwen/Qwen2.5-1.5B-Instruct", "stage": "sft", "do_train": True,
        "finetuning_type": "full", "cutoff_len": 256, "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2}  # fmt: skip
FIGURE = re.compile(r"^-?\d+\.\d\d$")


def render(renderable, width: int) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, no_color=True).print(renderable)
    return buf.getvalue()


def _status(tmp_path: Path, gpu_count: int) -> str:
    home = tmp_path / f"home-{gpu_count}"
    run_dir = home / "runs" / "R1"
    run_dir.mkdir(parents=True)
    (run_dir / "events.jsonl").write_text(
        json.dumps({"t": "2026-12-07T10:00:00.000+00:00", "event": "attempt_started", "attempt": 1}) + "\n"
        + json.dumps({"t": "2026-12-07T10:02:05.000+00:00", "event": "exited", "attempt": 1, "code": 0}) + "\n"
    )  # fmt: skip
    write_state(run_dir, RunState(id="R1", status=RunStatus.SUCCEEDED, gpu_count=gpu_count, exit_code=0,
                                  progress={"step": 8, "total_steps": 8, "loss": 1.5}))  # fmt: skip
    r = CliRunner().invoke(main, ["status", "R1"], env={"FTLAUNCH_HOME": str(home), "COLUMNS": "100"})
    assert r.exit_code == 0, r.output
    return r.output


def test_status_of_a_cpu_run_says_its_time_not_gpu_hours(tmp_path):
    cpu, gpu = _status(tmp_path, 0), _status(tmp_path, 2)
    assert "GPU-hours" not in cpu and re.search(r"CPU run, time so far\s+2m05s", cpu), cpu
    assert "CPU run" not in gpu and re.search(r"GPU-hours so far\s+0\.0694", gpu), gpu  # 125 s x 2 GPUs


def test_a_view_whose_gpus_were_not_recorded_keeps_gpu_hours():
    v = RunView(id="R", status=RunStatus.RUNNING, run_dir="/r", cost=CostView(wall_seconds=60.0))
    assert "GPU-hours so far" in render(status_table(v), 100)
    # the table's word, not a key of status --json: its cost keys stay the four they were
    assert list(CostView(gpus=0).to_json()) == ["tokens_per_second", "wall_seconds", "gpu_hours", "gpu_hours_projected"]


def _rows(text: str) -> dict[str, str]:
    """The memory table's rows: label -> value (two or more spaces between them)."""
    rows = {}
    for line in text.splitlines()[1:]:
        label, _, value = line.strip().partition("  ")
        rows[label] = value.strip()
    return rows


def _planned(gpu: str, host_ram: float | None = None):
    spec = spec_from_config(json.loads((MODELS / "qwen2.5-1.5b" / "config.json").read_text()))
    chooser = make_memory_chooser(spec, None, headroom=0.12, default_optim=("adamw_torch_fused", "test"))
    return plan(SEED, catalog_hardware(gpu, host_ram_gib=host_ram), memory_chooser=chooser)


def test_the_memory_table_of_a_cpu_plan_holds_only_gib_rows_and_names_the_optimizer_in_a_label():
    p = _planned("none", host_ram=64)
    assert p.memory is not None and p.memory.device == "host"
    rows = _rows(render(memory_table(p.memory), 100))
    figures = {k: v for k, v in rows.items() if k not in ("verdict", "micro-batch tried", "host RAM", "correction")}
    assert "optimizer (adamw_torch_fused)" in figures and "peak" in figures, rows
    assert not any(k.startswith("host") for k in figures), rows  # the whole table is host memory
    assert all(FIGURE.match(v) for v in figures.values()), figures


def test_offloaded_states_show_their_host_row_on_a_gpu_plan_only_when_there_are_some():
    p = _planned("A100-80GB")
    assert p.memory is not None and p.memory.device != "host"
    assert not any(k.startswith("host (") for k in _rows(render(memory_table(p.memory), 100)))
    offloaded = replace(p.memory, estimate=replace(p.memory.estimate, host_gib=12.5))
    assert _rows(render(memory_table(offloaded), 100))["host (offloaded states)"] == "12.50"
