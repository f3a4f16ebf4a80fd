"""Test-only fault injection into the REAL trainer process (put this folder on PYTHONPATH).

Wraps transformers.Trainer.training_step once transformers.trainer is imported:
  FTLAUNCH_TEST_STEP_SLEEP=0.2      sleep this long in every step (so a test can act mid-run)
  FTLAUNCH_TEST_OOM_ABOVE=N         raise a real torch.OutOfMemoryError when the micro-batch > N ...
  FTLAUNCH_TEST_OOM_FROM_STEP=K     ... but only from global step K on (an OOM after a checkpoint)
  FTLAUNCH_TEST_EVAL_OOM_ABOVE=N    raise it in evaluation when the eval batch > N
  FTLAUNCH_TEST_RECORD_ROWS=DIR     append what each micro-batch trained to DIR/rank<R>.jsonl: the optimizer
                                    step, the rank, the world size and the row ids ("(i)" in each row of the
                                    tiny dataset, decoded from the input_ids the trainer was given)
The traceback and exit code are the trainer's own.
"""

import importlib.abc
import importlib.util
import os
import sys
import time


def _patch(trainer_mod):
    Trainer = trainer_mod.Trainer
    original = Trainer.training_step
    sleep = float(os.environ.get("FTLAUNCH_TEST_STEP_SLEEP", "0") or 0)
    above = os.environ.get("FTLAUNCH_TEST_OOM_ABOVE")
    from_step = int(os.environ.get("FTLAUNCH_TEST_OOM_FROM_STEP", "0") or 0)

    record = os.environ.get("FTLAUNCH_TEST_RECORD_ROWS")

    def training_step(self, model, inputs, *args, **kwargs):
        if record:
            _record_rows(self, inputs, record)
        if sleep:
            time.sleep(sleep)
        if above is not None and self.args.per_device_train_batch_size > int(above):
            if self.state.global_step >= from_step:
                import torch

                raise torch.OutOfMemoryError(
                    "CUDA out of memory. Tried to allocate 1.79 GiB. GPU 0 has a total capacity of 31.73 GiB "
                    "of which 1.43 GiB is free. (injected by tests/inject/sitecustomize.py)"
                )
        return original(self, model, inputs, *args, **kwargs)

    Trainer.training_step = training_step

    eval_above = os.environ.get("FTLAUNCH_TEST_EVAL_OOM_ABOVE")
    if eval_above is not None:
        original_pred = Trainer.prediction_step

        def prediction_step(self, model, inputs, *args, **kwargs):
            if self.args.per_device_eval_batch_size > int(eval_above):
                import torch

                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB (injected, eval)")
            return original_pred(self, model, inputs, *args, **kwargs)

        Trainer.prediction_step = prediction_step


def _record_rows(trainer, inputs, folder):
    import json
    import re

    tokenizer = trainer.processing_class
    if tokenizer is None or not hasattr(tokenizer, "batch_decode"):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(trainer.model.config._name_or_path)
    texts = tokenizer.batch_decode(inputs["input_ids"].tolist(), skip_special_tokens=True)
    rows = [int(m.group(1)) if (m := re.search(r"\((\d+)\)", t)) else -1 for t in texts]
    args = trainer.args
    line = {"step": trainer.state.global_step + 1, "rank": args.process_index, "world": args.world_size, "rows": rows}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank{args.process_index}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "transformers.trainer":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def patched_exec(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = patched_exec
        return spec


if any(
    os.environ.get(k)
    for k in (
        "FTLAUNCH_TEST_STEP_SLEEP",
        "FTLAUNCH_TEST_OOM_ABOVE",
        "FTLAUNCH_TEST_EVAL_OOM_ABOVE",
        "FTLAUNCH_TEST_RECORD_ROWS",
    )
):
    sys.meta_path.insert(0, _Finder())
