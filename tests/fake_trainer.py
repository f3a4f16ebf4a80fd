#!/usr/bin/env python3
"""A scripted stand-in for llamafactory-cli, for failures a real run cannot produce cheaply.

FAKE_TRAINER_SCRIPT is a JSON list, one entry per attempt (the last repeats), each one of:
  {"exit": 137, "signal": 9}        die by SIGKILL with no traceback (the host OOM killer)
  {"oom": true, "rank": true}       print a torchrun-style [rank0]: CUDA OOM traceback, exit 1
  {"eval_oom": true}                OOM inside evaluation_loop, exit 1
  {"config_error": "..."}           ValueError from argument parsing, exit 1
  {"half_checkpoint": 6}            write checkpoint-6 with only a truncated model.safetensors, then die
  {"ok": true, "steps": 4}          write trainer_log.jsonl and a checkpoint, exit 0
  {"print_env": "HF_TOKEN"}         print that variable's value (secrets must be redacted in the log)
  {"print_key": "hub_token"}        print that config key's value (a secret given in the config)
  {"sleep": 30}                     stay alive that long first (a live run to race against), then go on
  {"oom_above": 2, "from_step": 12, "steps": 20, "save_steps": 4}
                                    train: a checkpoint every save_steps; from from_step on, a micro-batch
                                    above oom_above runs out of memory (torch's message, with its numbers)
  {"crash": "boom"}                 a RuntimeError traceback before any step, exit 1
  {"train": true, "steps": 20, "save_steps": 4, "crash_after_saves": 1, "hang_at": 7, "step_sleep": 0.05}
                                    train like the real trainer (resume from the last checkpoint-N); crash
                                    after saving that many checkpoints in this attempt; or print step
                                    hang_at, then hang forever (the stall watchdog's case); "enospc_at": k
                                    writes half of checkpoint-k, then fails as a full disk does;
                                    "zip_state": true writes optimizer.pt as a zip laid out as torch.save's;
                                    "load_check": true reads the resumed checkpoint's *.pt as torch.load
                                    would (every zip entry, CRCs too) and fails as the real trainer does
                                    ("PytorchStreamReader failed ...") when one does not read
It counts attempts in FAKE_TRAINER_COUNTER and records each config it was given.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import yaml


def main() -> int:
    if sys.argv[1] != "train":  # the passthrough commands (api, chat, export, version...)
        print(f"fake llamafactory-cli {' '.join(sys.argv[1:])}", flush=True)
        return 0
    cfg = yaml.safe_load(Path(sys.argv[2]).read_text())
    counter = Path(os.environ["FAKE_TRAINER_COUNTER"])
    n = int(counter.read_text()) if counter.exists() else 0
    tmp = counter.with_name(f".{counter.name}.{os.getpid()}")
    tmp.write_text(str(n + 1))
    tmp.replace(counter)  # atomic: a test polling the count never reads a half-written file
    with open(counter.with_suffix(".configs.jsonl"), "a") as f:
        f.write(json.dumps(cfg) + "\n")
    script = json.loads(os.environ["FAKE_TRAINER_SCRIPT"])
    step = script[min(n, len(script) - 1)]
    out = Path(cfg["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    print(f"fake trainer attempt {n + 1}: {step}", flush=True)
    if "print_env" in step:
        print(f"printed {os.environ.get(step['print_env'])}", flush=True)
    if "print_key" in step:
        print(f"printed {cfg.get(step['print_key'])}", flush=True)
    if "sleep" in step:
        time.sleep(step["sleep"])
    if "oom_above" in step:
        return train_until_oom(cfg, out, step)
    if "crash" in step:
        print(f"Traceback (most recent call last):\nRuntimeError: {step['crash']}", flush=True)
        return 1
    if step.get("train"):
        return train(out, step)
    if "signal" in step:
        os.kill(os.getpid(), step["signal"])
    if step.get("oom"):
        prefix = "[rank0]: " if step.get("rank") else ""
        print(
            f'{prefix}Traceback (most recent call last):\n{prefix}  File "trainer.py", in training_step\n'
            f"{prefix}torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.79 GiB.",
            flush=True,
        )
        if step.get("rank"):
            print("subprocess.CalledProcessError: Command '['torchrun', ...]' returned non-zero exit status 1.")
        return 1
    if step.get("eval_oom"):
        print(
            'Traceback (most recent call last):\n  File "trainer.py", in evaluation_loop\n'
            '  File "trainer.py", in prediction_step\n'
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB.",
            flush=True,
        )
        return 1
    if "config_error" in step:
        print(f"Traceback (most recent call last):\nValueError: {step['config_error']}", flush=True)
        return 1
    if "half_checkpoint" in step:
        ck = out / f"checkpoint-{step['half_checkpoint']}"
        ck.mkdir(exist_ok=True)
        (ck / "model.safetensors").write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a":')
        os.kill(os.getpid(), signal.SIGKILL)
    if step.get("ok"):
        steps = step.get("steps", 4)
        with open(out / "trainer_log.jsonl", "a") as f:
            for i in range(1, steps + 1):
                f.write(json.dumps({"current_steps": i, "total_steps": steps, "loss": 1.0 / i}) + "\n")
        return 0
    return 3


def train_until_oom(cfg: dict, out: Path, step: dict) -> int:
    """Resume from the last checkpoint-N like the real trainer, save every save_steps, OOM when the
    micro-batch is above oom_above from from_step on."""
    done = [int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if p.name.split("-")[1].isdigit()]
    start, total, save = max(done, default=0), step.get("steps", 20), step.get("save_steps", 4)
    micro = int(cfg.get("per_device_train_batch_size", 1))
    for i in range(start + 1, total + 1):
        if micro > step["oom_above"] and i >= step.get("from_step", 0):
            print(
                'Traceback (most recent call last):\n  File "trainer.py", in training_step\n'
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.79 GiB. GPU 0 has a total "
                "capacity of 79.15 GiB of which 1.43 GiB is free.",
                flush=True,
            )
            return 1
        with open(out / "trainer_log.jsonl", "a") as f:
            f.write(json.dumps({"current_steps": i, "total_steps": total, "loss": 1.0 / i}) + "\n")
        if i % save == 0:
            write_checkpoint(out, i)
    return 0


def train(out: Path, step: dict) -> int:
    """Resume from the last checkpoint-N, log each step, save every save_steps; crash or hang as told."""
    done = [int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if p.name.split("-")[1].isdigit()]
    start, total, save = max(done, default=0), step.get("steps", 20), step.get("save_steps", 4)
    if start and step.get("load_check"):
        print(f"Resuming training from {out / f'checkpoint-{start}'}.", flush=True)  # as llamafactory says it
        if not load_like_torch(out / f"checkpoint-{start}"):
            return 1
    saves = 0
    for i in range(start + 1, total + 1):
        time.sleep(step.get("step_sleep", 0.0))
        with open(out / "trainer_log.jsonl", "a") as f:
            f.write(json.dumps({"current_steps": i, "total_steps": total, "loss": 1.0 / i}) + "\n")
        if i == step.get("enospc_at"):  # the save of step i runs out of space half-way
            ck = out / f"checkpoint-{i}"
            ck.mkdir(exist_ok=True)
            (ck / "model.safetensors").write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a":')
            print("Traceback (most recent call last):\nOSError: [Errno 28] No space left on device", flush=True)
            return 1
        if i == step.get("hang_at"):
            print(f"step {i}: hanging", flush=True)
            time.sleep(3600)
        if i % save == 0:
            write_checkpoint(out, i, zip_state=bool(step.get("zip_state")))
            saves += 1
            if saves == step.get("crash_after_saves"):
                print(f"Traceback (most recent call last):\nRuntimeError: crash after checkpoint-{i}", flush=True)
                return 1
    return 0


def write_checkpoint(out: Path, step: int, zip_state: bool = False) -> Path:
    """A complete checkpoint-N as ftlaunch checks it: state, optimizer, a valid safetensors file.
    ``zip_state``: optimizer.pt is a zip archive laid out as torch.save's (else one byte, not a zip)."""
    ck = out / f"checkpoint-{step}"
    ck.mkdir(parents=True, exist_ok=True)
    (ck / "trainer_state.json").write_text("{}")
    if zip_state:
        write_torch_like_zip(ck / "optimizer.pt", {"data.pkl": b"\x80\x02}q\x00.", "data/0": bytes(range(256)) * 64})
    else:
        (ck / "optimizer.pt").write_bytes(b"x")
    header = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    (ck / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0\0\0")
    return ck


def write_torch_like_zip(path: Path, entries: dict) -> None:
    """A zip as torch.save writes one: stored entries under one folder named after the file."""
    import zipfile

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        for name, data in {**entries, "version": b"3\n"}.items():
            z.writestr(f"{path.stem}/{name}", data)


def load_like_torch(ck: Path) -> bool:
    """Read every *.pt of ``ck`` whole, as torch.load does (a zip's CRCs checked): False, with the real
    trainer's traceback printed, when one does not read."""
    import zipfile

    for f in sorted(ck.glob("*.pt")):
        try:
            with zipfile.ZipFile(f) as z:
                bad = z.testzip()  # the first entry whose CRC is wrong
        except (zipfile.BadZipFile, OSError):
            what = "failed reading zip archive: failed finding central directory"
        else:
            if bad is None:
                continue
            what = f"failed reading file {bad.split('/', 1)[-1]}: invalid header or archive is corrupted"
        print(
            "Traceback (most recent call last):\n"
            '  File "transformers/trainer.py", line 2325, in train\n'
            '  File "transformers/trainer.py", line 2480, in _inner_training_loop\n'
            '  File "transformers/trainer.py", line 3371, in _load_optimizer_and_scheduler\n'
            '  File "torch/serialization.py", line 1479, in load\n'
            f"RuntimeError: PytorchStreamReader {what}",
            flush=True,
        )
        return False
    return True


def write_config(folder: Path, **over) -> Path:
    """``folder``/c.yaml: the smallest training config these tests plan (output_dir ``folder``/out)."""
    cfg = {
        "stage": "sft",
        "do_train": True,
        "output_dir": str(folder / "out"),
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        **over,
    }
    path = folder / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def configs_seen(folder: Path) -> list[dict]:
    """The config of every start, in order (FAKE_TRAINER_COUNTER=``folder``/counter)."""
    return [json.loads(x) for x in (folder / "counter.configs.jsonl").read_text().splitlines()]


def install(folder: Path) -> Path:
    """An executable llamafactory-cli stand-in in ``folder`` that runs this script."""
    wrapper = folder / "fake-llamafactory-cli"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


if __name__ == "__main__":
    sys.exit(main())
