"""The disk shell (ftlaunch.run.disk): ENOSPC shapes captured from the real trainer, partial
checkpoints, free space, FTLAUNCH_HOME write errors. No trainer runs here (see test_e2e_disk.py)."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import pytest

from ftlaunch.run import disk

DATA = Path(__file__).resolve().parent.parent / "data" / "disk"


@pytest.mark.parametrize(
    "name, line",
    [
        ("safetensors", "SafetensorError: Error while serializing: I/O error: No space left on device (os error 28)"),
        ("torch_save", "RuntimeError: basic_ios::clear: iostream error"),
        ("tokenizers", "Exception: No space left on device (os error 28)"),
        ("oserror", "OSError: [Errno 28] No space left on device"),
    ],
)
def test_enospc_shapes_of_the_real_trainer(name, line):
    """Captured from llamafactory-cli 0.9.5 on a full tmpfs (transformers 5.6, torch 2.14)."""
    text = (DATA / f"enospc_{name}.log").read_text()
    assert disk.enospc_in(text)
    assert line in disk.enospc_line(text)


def test_torch_zip_writer_shapes_without_the_iostream_line():
    assert disk.enospc_in("RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 376640 vs 376528")
    assert disk.enospc_in(
        "[rank0]: RuntimeError: [enforce fail at inline_container.cc:595] . PytorchStreamWriter failed writing "
        "file data/3: file write failed"
    )
    assert disk.enospc_in("OSError: [Errno 122] Disk quota exceeded")
    assert disk.enospc_in('IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })')


def test_a_normal_run_and_an_oom_are_not_enospc():
    assert not disk.enospc_in((DATA / "train_ok.log").read_text())
    assert not disk.enospc_in("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.79 GiB.")
    assert not disk.enospc_in("RuntimeError: CUDA error: device-side assert triggered")


# ------------------------------------------------------------------------------ partial checkpoints


def _safetensors(path: Path, n: int = 16) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [n // 4], "data_offsets": [0, n]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * n)


def complete(out: Path, step: int) -> Path:
    ck = out / f"checkpoint-{step}"
    ck.mkdir(parents=True)
    _safetensors(ck / "model.safetensors")
    (ck / "optimizer.pt").write_bytes(b"x" * 100)
    (ck / "trainer_state.json").write_text("{}")
    return ck


def test_remove_partial_deletes_only_incomplete_folders_newer_than_the_last_complete(tmp_path):
    out = tmp_path / "out"
    old_partial = complete(out, 2)
    (old_partial / "trainer_state.json").unlink()  # incomplete, but older than a complete one: kept
    complete(out, 4)
    failed = out / "checkpoint-6"  # the save that hit ENOSPC: weights written, optimizer.pt half
    failed.mkdir()
    _safetensors(failed / "model.safetensors")
    (failed / "optimizer.pt").write_bytes(b"x" * 40)
    assert disk.partial_checkpoints(out) == [failed]
    size = sum(f.stat().st_size for f in failed.iterdir())
    removed = disk.remove_partial(out)
    assert removed.names == ("checkpoint-6",) and removed.bytes_freed == size
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert disk.remove_partial(out) == disk.Removed((), 0)


def test_save_only_model_checkpoints_are_complete_without_optimizer(tmp_path):
    out = tmp_path / "out"
    ck = complete(out, 4)
    (ck / "optimizer.pt").unlink()
    assert disk.partial_checkpoints(out, weights_only=True) == []
    assert disk.partial_checkpoints(out, weights_only=False) == [ck]


# ------------------------------------------------------------------------------ free space, messages


def test_free_bytes_of_a_path_not_made_yet_is_its_parents(tmp_path):
    target = tmp_path / "not" / "yet" / "out"
    assert disk.existing_parent(target) == tmp_path
    st = os.statvfs(tmp_path)
    assert abs(disk.free_bytes(target) - st.f_bavail * st.f_frsize) < 64 * 2**20
    assert disk.mount_point(target) == disk.mount_point(tmp_path)
    assert str(disk.mount_point(tmp_path)) in disk.filesystem_name(target)


def test_disk_message_names_filesystem_free_space_and_checkpoint(tmp_path):
    text = disk.disk_message(tmp_path, 1_823_664, free=1_000_000)
    assert str(disk.mount_point(tmp_path)) in text
    assert "1.0 MB free" in text and "one checkpoint takes 1.8 MB" in text


# ------------------------------------------------------------------------------------ FTLAUNCH_HOME


def test_home_write_problem_names_the_file_under_home(tmp_path):
    home = tmp_path / "home"
    exc = OSError(errno.ENOSPC, "No space left on device", str(home / "runs" / "x" / "state.json"))
    text = disk.home_write_problem(exc, home)
    assert text and f"FTLAUNCH_HOME={home}" in text and "state.json" in text and "free" in text
    ro = OSError(errno.EROFS, "Read-only file system", str(home / "locks" / "a.lock"))
    assert "Read-only file system" in disk.home_write_problem(ro, home)


def test_home_write_problem_ignores_other_paths_and_other_errors(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    elsewhere = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "x"))
    assert disk.home_write_problem(elsewhere, home) is None
    assert disk.home_write_problem(FileNotFoundError(errno.ENOENT, "nope", str(home / "x")), home) is None
    # no file name (a flush) and a home with room and write access: not blamed on it
    assert disk.home_write_problem(OSError(errno.ENOSPC, "No space left on device"), home) is None


# ------------------------------------------------------------------------------------- dataset rows


def test_dataset_rows_of_local_files_capped_and_split(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"instruction": str(i)} for i in range(100)]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"i": i}) + "\n" for i in range(30)))
    info = {"a": {"file_name": "a.json"}, "b": {"file_name": "b.jsonl"}, "hub": {"hf_hub_url": "org/ds"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    base = {"dataset_dir": str(tmp_path)}
    assert disk.dataset_rows({**base, "dataset": "a,b"}) == 130
    assert disk.dataset_rows({**base, "dataset": "a, b", "max_samples": 50}) == 80  # per dataset
    assert disk.dataset_rows({**base, "dataset": "a", "val_size": 0.1}) == 90
    assert disk.dataset_rows({**base, "dataset": "a,hub"}) is None  # remote: unknown before the run
    assert disk.dataset_rows({**base, "dataset": "a", "packing": True}) is None
    assert disk.dataset_rows({**base, "dataset": "missing"}) is None


# ------------------------------------------------------------------------------ a save under way


@pytest.mark.parametrize(
    "state, lacks",
    [("not begun", 1000), ("half written", 1000 - 300), ("complete", 0)],
)
def test_the_space_a_save_under_way_has_still_to_write_is_not_free_for_the_next(tmp_path, monkeypatch, state, lacks):
    """HF logs step 12 before it saves checkpoint-12: judged at that record, the save at 18 finds
    what is free now less what checkpoint-12 has still to write (a loaded CI machine read the record
    mid-save, counted the rest free... and the other way round stopped a run that had room)."""
    from ftlaunch.plan.disk import DiskForecast

    fc = DiskForecast(
        checkpoint_bytes=1000, final_bytes=0, save_every=6, total_steps=24, saves=4, kept=4, total_bytes=0
    )
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(disk, "free_bytes", lambda p: 5000)
    if state == "half written":
        (out / "checkpoint-12").mkdir()
        (out / "checkpoint-12" / "model.safetensors").write_bytes(b"\0" * 300)
    elif state == "complete":
        complete(out, 12)
    assert disk.free_for_next_save(out, fc, step=12, nxt=18) == 5000 - lacks
    # a step that is no save step: nothing under way
    assert disk.free_for_next_save(out, fc, step=13, nxt=18) == 5000


def test_the_folder_of_the_judged_save_itself_counts_as_free(tmp_path, monkeypatch):
    from ftlaunch.plan.disk import DiskForecast

    fc = DiskForecast(
        checkpoint_bytes=1000, final_bytes=0, save_every=6, total_steps=24, saves=4, kept=4, total_bytes=0
    )
    out = tmp_path / "out"
    (out / "checkpoint-18").mkdir(parents=True)
    (out / "checkpoint-18" / "optimizer.pt").write_bytes(b"\0" * 400)
    monkeypatch.setattr(disk, "free_bytes", lambda p: 5000)
    assert disk.free_for_next_save(out, fc, step=17, nxt=18) == 5400
