"""`ftlaunch estimate` and `ftlaunch plot` against the real llamafactory-cli on the tiny model.

What is checked, and against what:
- token counts: the estimate's tokens x epochs equal the trainer's own count
  (``include_num_input_tokens_seen: non_padding``, i.e. the attention-mask sum over every batch)
  exactly, and its per-sample lengths and label tokens equal a count over the tokenized dataset
  llamafactory saves (``tokenized_path``) exactly;
- padding: with sequential batches (``disable_shuffling``) the estimate's padded tokens equal the
  trainer's ``include_num_input_tokens_seen: all`` count exactly;
- packing: the rows the estimate's knapsack makes equal the rows llamafactory's packing made;
- time: a probe gives a wall-time range around its central figure (how close it comes to a real
  run's wall time is a figure of the machine's load, measured by scripts/bench_estimate.py, not a test);
- plot: a PNG of a real run's trainer_log.jsonl, with a restart.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftlaunch.estimate import padding as est_pad
from ftlaunch.estimate import probe as est_run

from ..conftest import tiny_config, venv_bin, write_yaml

pytestmark = pytest.mark.e2e

EPOCHS = 8  # 128 steps: long enough that training is a good part of the wall time, short enough for CI


def make_env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        FTLAUNCH_HOME=str(root / "ftl-home"),
        HF_HOME=str(root / "hf-home"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        MPLCONFIGDIR=str(root / "mpl"),
        XDG_CACHE_HOME=str(root / "cache"),
        CUDA_VISIBLE_DEVICES="",
    )
    env.pop("FTLAUNCH_LLAMAFACTORY_CLI", None)
    return env


def ftl(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv_bin() / "ftlaunch"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def estimate_json(cfg: Path, *args: str, env: dict[str, str]) -> dict:
    r = ftl("estimate", str(cfg), "--json", *args, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def train(cfg: Path, *overrides: str, env: dict[str, str]) -> float:
    """Run llamafactory-cli train as a user would; return its wall time."""
    t0 = time.monotonic()
    r = subprocess.run(
        [str(venv_bin() / "llamafactory-cli"), "train", str(cfg), *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return wall


def final_record(out: Path) -> dict:
    return [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines()][-1]


def base_config(tiny: Path, out: Path, **over) -> dict:
    # cutoff 48 truncates about two thirds of the tiny samples; bf16 off and overwrite off already,
    # so the plan for this CPU changes nothing that matters and the estimate is of this very config.
    cfg = tiny_config(
        tiny,
        out,
        cutoff_len=48,
        bf16=False,
        overwrite_output_dir=False,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        save_steps=40,
    )
    cfg.update(over)
    return cfg


@pytest.fixture(scope="module")
def full(tiny, tmp_path_factory):
    """An estimate with a probe, then the full run it predicts (tokens counted, dataset saved)."""
    root = tmp_path_factory.mktemp("e2e-estimate")
    env = make_env(root)
    out = root / "out"
    cfg = write_yaml(
        root / "full.yaml",
        base_config(tiny, out, num_train_epochs=EPOCHS, include_num_input_tokens_seen="non_padding"),
    )
    t0 = time.monotonic()
    estimate = estimate_json(cfg, "--probe-steps", "20", "--warmup-steps", "5", env=env)
    estimate_wall = time.monotonic() - t0
    wall = train(cfg, f"tokenized_path={root / 'tokenized'}", env=env)
    last = final_record(out)
    figures = {
        "predicted_train_seconds": round(EPOCHS * estimate["total_tokens"] / estimate["tokens_per_second"], 2),
        "actual_train_seconds": round(last["total_tokens"] / last["throughput"], 2),  # the trainer's clock
        "estimate_seconds": round(estimate_wall, 1),
        "probe": estimate["probe"],
        "predicted_wall_seconds": [round(h * 3600, 1) for h in estimate["wall_hours"]],
        "predicted_central_seconds": estimate["wall_seconds_central"],
        "actual_wall_seconds": round(wall, 1),
        "load_average": os.getloadavg(),
    }
    print("\nprobe vs actual:", json.dumps(figures))  # shown with pytest -s; quoted in docs/estimate.md
    return {"env": env, "root": root, "out": out, "cfg": cfg, "estimate": estimate, "wall": wall}


def tokenized_counts(path: Path, env: dict[str, str]) -> dict:
    """Count over the dataset llamafactory saved, in a child (the test process stays light)."""
    code = (
        "import json, sys\n"
        "from datasets import load_from_disk\n"
        "d = load_from_disk(sys.argv[1])['train']\n"
        "lengths = [len(x) for x in d['input_ids']]\n"
        "labels = sum(1 for row in d['labels'] for t in row if t != -100)\n"
        "print(json.dumps({'rows': len(d), 'lengths': lengths, 'labels': labels}))\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_token_counts_equal_what_the_trainer_counts(full):
    e, out = full["estimate"], full["out"]
    trainer = final_record(out)
    assert e["samples"] == e["rows"] == 64 and e["epochs"] == EPOCHS
    # the trainer's own count: the attention-mask sum of every batch of every epoch
    assert trainer["total_tokens"] == EPOCHS * e["total_tokens"]
    assert trainer["total_steps"] == e["optimizer_steps"] == EPOCHS * e["steps_per_epoch"] == EPOCHS * 16
    saved = tokenized_counts(full["root"] / "tokenized", full["env"])
    assert saved["rows"] == e["rows"]
    assert sum(saved["lengths"]) == e["total_tokens"]
    assert saved["labels"] == e["label_tokens"]
    # a truncated sample fills the cutoff (to within a token of llamafactory's split of the budget)
    assert max(saved["lengths"]) <= 48 and 0 < e["truncated"] <= sum(1 for x in saved["lengths"] if x >= 47)
    assert e["length_percentiles"]["max"] > 48  # percentiles are of the samples before the cutoff


def test_probe_gives_a_wall_time_range(full):
    # No comparison with the full run's wall time here: on shared cores the probe and the run meet
    # different loads (7.9 s predicted vs 73 s measured once, issue 22). scripts/bench_estimate.py
    # measures that error, with the load average beside it.
    e = full["estimate"]
    assert e["time_source"] == "probe" and e["tokens_per_second"] > 0 and e["seconds_per_step"] > 0
    low, high = (h * 3600 for h in e["wall_hours"])
    central = e["wall_seconds_central"]
    assert 0 < low <= central <= high
    assert e["gpu_hours"] == [0.0, 0.0]  # no GPU here: nothing billed
    assert not list((full["root"] / "ftl-home" / "scratch").glob("probe-*"))  # the probe cleaned up
    assert Path(e["histogram"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_padded_tokens_equal_the_trainers_count_with_sequential_batches(tiny, tmp_path):
    env = make_env(tmp_path)
    out = tmp_path / "out"
    cfg = write_yaml(
        tmp_path / "seq.yaml",
        base_config(
            tiny,
            out,
            num_train_epochs=1.0,
            disable_shuffling=True,
            include_num_input_tokens_seen="all",
            save_strategy="no",
        ),
    )
    stats = est_run.count_tokens(_yaml(cfg), env, tmp_path / "count")
    padding = est_pad.padding_for(stats, micro_batch=4, sampling=est_pad.sampling_of(_yaml(cfg)))
    assert padding.sampling == "sequential"
    train(cfg, env=env)
    # every micro-batch padded to a multiple of 8 of its longest sample, exactly as predicted
    assert final_record(out)["total_tokens"] == padding.padded_tokens > stats.total_tokens


def _yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def test_packed_rows_equal_llamafactorys_packing(tiny, tmp_path):
    env = make_env(tmp_path)
    cfg = write_yaml(tmp_path / "packed.yaml", base_config(tiny, tmp_path / "out", cutoff_len=64, packing=True))
    e = estimate_json(cfg, env=env)
    # rows: what llamafactory's packing made; packed_rows: the estimate's knapsack over the samples
    assert e["packing"] and e["rows"] == e["packed_rows"] < e["samples"] == 64
    assert e["padding_share"] > 0 and e["truncated"] > 0
    assert e["padded_tokens_packed"] == e["rows"] * 64


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plot_draws_a_real_runs_log_with_a_restart(full, tmp_path):
    from ftlaunch.files import write_json_atomic
    from ftlaunch.run.state import STATE_VERSION
    from ftlaunch.run.store import append_event

    env = full["env"]
    records = (full["out"] / "trainer_log.jsonl").read_text().splitlines()
    # the same run as if it had died after step 100 and resumed from checkpoint-80 (saves every 40)
    out = tmp_path / "out"
    out.mkdir()
    first = [x for x in records if json.loads(x)["current_steps"] <= 100 and "loss" in x]
    second = [x for x in records if json.loads(x)["current_steps"] > 80]
    (out / "trainer_log.jsonl").write_text("\n".join(first + second) + "\n")
    run_dir = Path(env["FTLAUNCH_HOME"]) / "runs" / "20260101-000000-e2e0"
    run_dir.mkdir(parents=True)
    state = {"version": STATE_VERSION, "id": run_dir.name, "name": "tiny", "output_dir": str(out)}
    write_json_atomic(run_dir / "state.json", state)
    (run_dir / "events.jsonl").write_text("")
    append_event(run_dir, "attempt_started", attempt=1, resume_from=None)
    append_event(run_dir, "exited", attempt=1, code=1)
    append_event(run_dir, "attempt_started", attempt=2, resume_from="checkpoint-80")
    r = ftl("plot", "tiny", env=env)
    assert r.returncode == 0, r.stderr
    png = run_dir / "progress.png"
    assert png_size(png) == (1000, 650) and png.stat().st_size > 20_000
    r2 = ftl("plot", str(full["out"]), "--out", str(tmp_path / "real.png"), env=env)
    assert r2.returncode == 0, r2.stderr
    assert png_size(tmp_path / "real.png") == (1000, 650)
    missing = ftl("plot", "no-such-run", env=env)
    assert missing.returncode == 6 and "Traceback" not in missing.stderr
