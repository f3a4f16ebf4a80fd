"""A torn optimizer.pt is no complete checkpoint, and a checkpoint the trainer cannot load is set aside
(issue 40, fault 3).

1. The content check (``progress.torch_file_problem``) on files the venv's torch really wrote, cut
   short at many points, each also handed to torch.load: every cut torch refuses, the check refuses.
2. The classification of a load failure on resume (pure): a crash that names the checkpoint, only in
   the Trainer's resume frames.
3. ``ftlaunch train`` / ``ftlaunch resume`` as real processes with the scripted trainer
   (tests/fake_trainer.py, ``zip_state``/``load_check``: it fails to resume from a bad optimizer.pt as
   the real one does): a torn optimizer.pt is set aside before the resume; one that looks whole but does
   not load is set aside after the attempt that failed; either way the run resumes from the checkpoint
   before, and every set-aside folder is kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from ftlaunch.run.checkpoints import set_aside_unloadable
from ftlaunch.run.progress import checkpoint_problems, last_complete_checkpoint, torch_file_problem
from ftlaunch.run.recovery import UNLOADABLE, classify
from ftlaunch.run.state import FailureKind

from ..conftest import venv_bin
from ..fake_trainer import install, write_checkpoint, write_config
from ..helpers import said


@pytest.fixture(scope="module")
def torch_files(tmp_path_factory):
    """Files the venv's real torch.save wrote: an AdamW state, an LR scheduler's, an RNG state, and one
    in torch's legacy (non-zip) format. Written in a child so this test process never imports torch."""
    folder = tmp_path_factory.mktemp("torchfiles")
    code = """
import sys, torch
d = sys.argv[1]
model = torch.nn.Linear(64, 64)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(4, 64)).sum().backward()
opt.step()
torch.save(opt.state_dict(), f"{d}/optimizer.pt")
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
torch.save(sched.state_dict(), f"{d}/scheduler.pt")
torch.save({"python": 1, "cpu": torch.random.get_rng_state()}, f"{d}/rng_state_1.pth")
torch.save({"w": torch.ones(8)}, f"{d}/legacy.pt", _use_new_zipfile_serialization=False)
"""
    r = subprocess.run([str(venv_bin() / "python"), "-c", code, str(folder)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"torch cannot write here: {r.stderr.strip().splitlines()[-1:]}")
    return folder


def torch_loads(paths: list[Path]) -> list[bool]:
    """Whether the venv's torch.load reads each file (weights_only, as the Trainer loads them)."""
    code = """
import json, sys, torch
ok = []
for p in sys.argv[1:]:
    try:
        torch.load(p, weights_only=True, map_location="cpu")
        ok.append(True)
    except Exception:
        ok.append(False)
print(json.dumps(ok))
"""
    r = subprocess.run([str(venv_bin() / "python"), "-c", code, *map(str, paths)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def cut(src: Path, dst: Path, size: int) -> Path:
    dst.write_bytes(src.read_bytes()[:size])
    return dst


# ---------------------------------------------------------------- 1. the content check


def test_whole_torch_files_pass_and_every_cut_fails_as_torch_load_does(torch_files, tmp_path):
    whole = [torch_files / n for n in ("optimizer.pt", "scheduler.pt", "rng_state_1.pth")]
    assert [torch_file_problem(p) for p in whole] == [None, None, None]
    opt = torch_files / "optimizer.pt"
    size = opt.stat().st_size
    points = sorted({1, 30, size // 4, size // 2, size - 100, size - 22, size - 1})
    cuts = [cut(opt, tmp_path / f"cut-{n}.pt", n) for n in points]
    assert torch_loads(whole + cuts) == [True] * 3 + [False] * len(cuts)
    problems = {p.name: torch_file_problem(p) for p in cuts}
    assert all(problems.values()), problems
    assert "zip index does not read" in problems[f"cut-{size // 2}.pt"]


def test_a_zeroed_local_header_is_caught_and_a_legacy_pickle_is_accepted(torch_files, tmp_path):
    opt = torch_files / "optimizer.pt"
    with zipfile.ZipFile(opt) as z:
        entry = z.infolist()[1]
    data = bytearray(opt.read_bytes())
    data[entry.header_offset : entry.header_offset + 4] = b"\0\0\0\0"
    bad = tmp_path / "optimizer.pt"
    bad.write_bytes(bytes(data))
    assert torch_file_problem(bad) == f"no local header for {entry.filename} at byte {entry.header_offset}"
    # torch's legacy format is a bare pickle: nothing to check without unpickling, accepted as it is
    assert torch_file_problem(torch_files / "legacy.pt") is None
    assert torch_loads([torch_files / "legacy.pt"]) == [True]
    (tmp_path / "empty.pt").write_bytes(b"")
    assert torch_file_problem(tmp_path / "empty.pt") == "empty"


@pytest.mark.parametrize("rel", ["optimizer.pt", "scheduler.pt", "rng_state_1.pth", "global_step8/optim_states.pt"])
def test_a_checkpoint_with_any_torn_torch_file_is_incomplete(torch_files, tmp_path, rel):
    ck = write_checkpoint(tmp_path / "out", 8)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state_1.pth"):
        (ck / name).write_bytes((torch_files / name).read_bytes())
    (ck / "global_step8").mkdir()
    (ck / "global_step8" / "optim_states.pt").write_bytes((torch_files / "optimizer.pt").read_bytes())
    assert checkpoint_problems(ck) == []
    whole = (ck / rel).read_bytes()
    (ck / rel).write_bytes(whole[: len(whole) // 2])
    (problem,) = checkpoint_problems(ck)
    assert problem.startswith(f"{rel} is truncated or corrupt (")


def test_the_newest_complete_checkpoint_skips_a_torn_optimizer(torch_files, tmp_path):
    out = tmp_path / "out"
    for step in (4, 8):
        ck = write_checkpoint(out, step)
        (ck / "optimizer.pt").write_bytes((torch_files / "optimizer.pt").read_bytes())
    opt = out / "checkpoint-8" / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[: opt.stat().st_size // 2])
    assert last_complete_checkpoint(out)[0] == 4


# ---------------------------------------------------------------- 2. a load failure on resume, classified

TORCH_TRACE = (
    "Traceback (most recent call last):\n"
    '  File "/x/transformers/trainer.py", line 2325, in train\n'
    '  File "/x/transformers/trainer.py", line 2480, in _inner_training_loop\n'
    '  File "/x/transformers/trainer.py", line 3371, in _load_optimizer_and_scheduler\n'
    "    torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location=map_location)\n"
    '  File "/x/torch/serialization.py", line 1479, in load\n'
    "[rank0]: RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory\n"
)
SAFETENSORS_TRACE = (
    "Traceback (most recent call last):\n"
    '  File "/x/transformers/trainer.py", line 2282, in train\n'
    '  File "/x/transformers/trainer.py", line 3319, in _load_from_checkpoint\n'
    "safetensors_rust.SafetensorError: Error while deserializing header: MetadataIncompleteBuffer\n"
)
BASE_MODEL_TRACE = (
    "Traceback (most recent call last):\n"
    '  File "/x/transformers/modeling_utils.py", line 4900, in from_pretrained\n'
    "safetensors_rust.SafetensorError: Error while deserializing header: MetadataIncompleteBuffer\n"
)


@pytest.mark.parametrize("log", [TORCH_TRACE, SAFETENSORS_TRACE], ids=["optimizer.pt", "model.safetensors"])
def test_a_load_failure_on_resume_is_a_crash_that_blames_the_checkpoint(log):
    ex = classify(1, "Resuming training from out/checkpoint-8.\n" + log)
    assert ex.kind is FailureKind.CRASH and "the checkpoint it resumed from does not load" in ex.message
    assert ex.detail[UNLOADABLE] == log.strip().splitlines()[-1].removeprefix("[rank0]: ")


def test_the_same_error_loading_the_base_model_blames_no_checkpoint():
    assert UNLOADABLE not in classify(1, BASE_MODEL_TRACE).detail


def test_only_the_checkpoint_the_attempt_resumed_from_is_set_aside(tmp_path):
    out = tmp_path / "out"
    for step in (4, 8):
        write_checkpoint(out, step)
    assert set_aside_unloadable(out, None, "x") is None  # started from the base model: nothing to blame
    assert set_aside_unloadable(out, "../elsewhere", "x") is None
    moved = set_aside_unloadable(out, "checkpoint-8", "RuntimeError: bad", now=100)
    assert moved.moved_to == "incomplete-checkpoint-8-100" and (out / moved.moved_to / "optimizer.pt").exists()
    write_checkpoint(out, 8)  # saved again after the set-aside, failing again within the second: a new name
    assert set_aside_unloadable(out, "checkpoint-8", "x", now=100).moved_to == "incomplete-checkpoint-8-100-2"
    assert last_complete_checkpoint(out)[0] == 4


# ---------------------------------------------------------------- 3. end to end: ftlaunch train, then resume


def ftl(*args: str, env: dict, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv_bin() / "ftlaunch"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def two_checkpoints(tmp_path: Path) -> tuple[dict, Path, str]:
    """A failed run whose output_dir holds checkpoint-4 and checkpoint-8 with zip optimizer states: the
    first attempt crashes after its second save, the second is a config error (never retried)."""
    env = {
        **os.environ,
        "FTLAUNCH_LLAMAFACTORY_CLI": str(install(tmp_path)),
        "FAKE_TRAINER_COUNTER": str(tmp_path / "counter"),
        "FAKE_TRAINER_SCRIPT": json.dumps(
            [
                {"train": True, "steps": 12, "save_steps": 4, "crash_after_saves": 2, "zip_state": True},
                {"config_error": "Undefined dataset x"},
            ]
        ),
    }
    r = ftl("train", str(write_config(tmp_path)), "--gpu", "none", "--foreground", "--name", "torn", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    env["FAKE_TRAINER_SCRIPT"] = json.dumps(
        [{"train": True, "steps": 12, "save_steps": 4, "zip_state": True, "load_check": True}]
    )
    return env, out, (tmp_path / "counter").read_text()


def events_of(env: dict, run: str) -> list[dict]:
    run_dir = Path(json.loads(ftl("status", run, "--json", env=env).stdout)["run_dir"])
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


def resumed_steps(out: Path, after: int) -> list[int]:
    steps = [json.loads(x)["current_steps"] for x in (out / "trainer_log.jsonl").read_text().splitlines()]
    return steps[after:]


def test_resume_sets_a_torn_optimizer_aside_and_resumes_from_the_checkpoint_before(tmp_path):
    env, out, before = two_checkpoints(tmp_path)
    opt = out / "checkpoint-8" / "optimizer.pt"
    torn = opt.read_bytes()[: opt.stat().st_size // 2]
    opt.write_bytes(torn)  # a save killed half-way through optimizer.pt
    logged = len((out / "trainer_log.jsonl").read_text().splitlines())

    r = ftl("resume", "torn", "--foreground", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert int((tmp_path / "counter").read_text()) == int(before) + 1  # one attempt: checkpoint-8 never tried
    assert resumed_steps(out, logged) == list(range(5, 13))  # from checkpoint-4 on
    (aside,) = out.glob("incomplete-checkpoint-8-*")
    assert (aside / "optimizer.pt").read_bytes() == torn  # kept as it was, never deleted
    assert said(f"ftlaunch: set aside checkpoint-8 -> {aside.name} (optimizer.pt is truncated", r.stdout + r.stderr)
    events = events_of(env, "torn")
    (ev,) = [e for e in events if e["event"] == "checkpoint_set_aside"]
    assert ev["checkpoint"] == "checkpoint-8" and "optimizer.pt is truncated" in ev["problems"][0]
    started = [e for e in events if e["event"] == "attempt_started"][-1]
    assert started["resume_from"] == "checkpoint-4" and aside.name in started["set_aside"][0]


def test_a_checkpoint_the_trainer_cannot_load_is_set_aside_and_the_one_before_is_tried(tmp_path):
    env, out, before = two_checkpoints(tmp_path)
    opt = out / "checkpoint-8" / "optimizer.pt"
    damage_a_tensor(opt)
    data = opt.read_bytes()
    assert checkpoint_problems(out / "checkpoint-8") == []  # no structure check can see this one

    r = ftl("resume", "torn", "--foreground", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert int((tmp_path / "counter").read_text()) == int(before) + 2  # checkpoint-8 failed once, then 4
    (aside,) = out.glob("incomplete-checkpoint-8-*")
    assert (aside / "optimizer.pt").read_bytes() == data
    events = events_of(env, "torn")
    (ev,) = [e for e in events if e["event"] == "checkpoint_set_aside"]
    assert ev["reason"] == "unloadable" and ev["checkpoint"] == "checkpoint-8" and ev["moved_to"] == aside.name
    assert "PytorchStreamReader failed reading file data/0" in ev["problems"][0]
    retry = [e for e in events if e["event"] == "retry"][-1]
    assert "does not load" in retry["message"] and retry["message"].endswith("from checkpoint-4"), retry
    started = [e for e in events if e["event"] == "attempt_started"]
    assert [e["resume_from"] for e in started[-2:]] == ["checkpoint-8", "checkpoint-4"]


def damage_a_tensor(opt: Path) -> None:
    """The bytes of optimizer.pt's first tensor overwritten: its zip structure stays whole."""
    with zipfile.ZipFile(opt) as z:
        entry = z.getinfo("optimizer/data/0")
    data = bytearray(opt.read_bytes())
    start = entry.header_offset + 30 + len(entry.filename)  # stored by zipfile: no extra field
    data[start : start + 16] = b"\xff" * 16
    opt.write_bytes(bytes(data))


def test_unloadable_checkpoints_are_set_aside_one_per_attempt_within_the_crash_budget(tmp_path):
    from ftlaunch.run.store import read_events, read_state
    from ftlaunch.run.supervisor import Supervisor

    from .test_recovery import make_run

    run_dir, env = make_run(tmp_path, [{"train": True, "steps": 12, "save_steps": 4, "load_check": True}])
    out = tmp_path / "out"
    for step in (4, 8):
        damage_a_tensor(write_checkpoint(out, step, zip_state=True) / "optimizer.pt")
    assert last_complete_checkpoint(out)[0] == 8  # both look whole

    assert Supervisor(run_dir, env, poll=0.05).run() == 1  # the crash budget (1 retry) ends it
    assert int((tmp_path / "counter").read_text()) == 2  # one attempt per checkpoint, no loop
    state = read_state(run_dir)
    assert state.status == "failed" and "crashed 2 times" in state.message, state.message
    aside = sorted(e["checkpoint"] for e in read_events(run_dir) if e["event"] == "checkpoint_set_aside")
    assert aside == ["checkpoint-4", "checkpoint-8"]
    assert sorted(p.name.rsplit("-", 1)[0] for p in out.iterdir() if p.is_dir()) == [
        "incomplete-checkpoint-4",
        "incomplete-checkpoint-8",
    ]  # both kept, none deleted


# ---------------------------------------------------------------- 4. the real trainer (e2e lane)


@pytest.mark.e2e
def test_the_real_trainer_resumes_past_a_torn_optimizer_and_an_unloadable_checkpoint(tiny, tmp_path):
    """Checkpoints 2, 4, 6 of the tiny model, the run stopped; then 6's optimizer.pt cut to half (caught
    by content, before the attempt) and 4's model.safetensors given a dtype safetensors does not know
    (its header parses: only the trainer's load finds it). `resume` goes on from checkpoint-2."""
    from ..conftest import child_env, tiny_config, write_yaml
    from .test_e2e_detached import slow_env, trainer_steps, wait_for

    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, out, max_steps=24, save_steps=2))
    r = ftl("train", str(cfg), "--name", "real", env=slow_env("0.5"))
    assert r.returncode == 0, r.stdout + r.stderr
    wait_for(lambda: (last_complete_checkpoint(out) or (0,))[0] >= 6)
    assert ftl("stop", "real", env=child_env()).returncode == 0
    later = tmp_path / "later"  # a save after checkpoint-6 that came before the stop: out of the way
    later.mkdir()
    for p in out.glob("checkpoint-*"):
        if int(p.name.split("-")[1]) > 6:
            p.rename(later / p.name)
    opt = out / "checkpoint-6" / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[: opt.stat().st_size // 2])
    weights = out / "checkpoint-4" / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw.replace(b'"dtype":"F32"', b'"dtype":"X32"', 1))
    assert checkpoint_problems(out / "checkpoint-4") == [] and raw != weights.read_bytes()
    logged = len(trainer_steps(out))

    r = ftl("resume", "real", "--foreground", env=child_env(), timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    assert trainer_steps(out)[logged:] == list(range(3, 25))  # from checkpoint-2 on
    events = events_of(child_env(), "real")
    aside = {e["checkpoint"]: e for e in events if e["event"] == "checkpoint_set_aside"}
    assert "optimizer.pt is truncated" in aside["checkpoint-6"]["problems"][0]
    assert aside["checkpoint-4"]["reason"] == "unloadable"
    assert "Error while deserializing header" in aside["checkpoint-4"]["problems"][0]
    assert len(list(out.glob("incomplete-checkpoint-6-*"))) == len(list(out.glob("incomplete-checkpoint-4-*"))) == 1
