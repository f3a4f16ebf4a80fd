"""First on PYTHONPATH of a local trainer run by torchrun over several processes (run/trainer.py
``with_torchrun_beside``): lets several CPU processes resume a checkpoint's optimizer.pt.

Why: accelerate gives a gloo (MULTI_CPU) process the device ``cpu:N`` (state.py ``set_device``), and
transformers' Trainer loads optimizer.pt with ``map_location=args.device`` when the world size is above
1 (trainer.py ``_load_optimizer_and_scheduler``). torch turns that device into the location string
"cpu:0", which none of its deserializers accepts ("don't know how to restore data location of
torch.storage.UntypedStorage (tagged with cpu:0)"): a resume onto 2 CPU processes fails. This
registers, through torch's public ``torch.serialization.register_package``, a deserializer that takes
"cpu:N" as the CPU. Nothing else changes: saving is untouched (its tagger claims no storage), other
locations ("cuda:0", ...) fall through to torch's own, so GPU runs are as before.

Only one module named ``sitecustomize`` is imported at start-up: this one then runs the next
``sitecustomize.py`` on sys.path (the user's, or the interpreter's), so it hides none.
"""

import importlib.abc
import importlib.util
import os
import re
import sys

_CPU_N = re.compile(r"cpu:\d+")


def _cpu_index_deserializer(obj, location):
    if isinstance(location, str) and _CPU_N.fullmatch(location):
        return obj  # torch.load reads storages onto the CPU before it restores their location
    return None


def _never_tags(_obj):
    return None


def _run_next_sitecustomize():
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.getcwd())
        if folder == here:
            continue
        path = os.path.join(folder, "sitecustomize.py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_ftlaunch_next_sitecustomize", path)
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module
                spec.loader.exec_module(module)
            return


class _AfterTorchSerialization(importlib.abc.MetaPathFinder):
    """Registers the deserializer once torch.serialization is imported: importing torch here would slow
    every Python process started with this PYTHONPATH (torchrun's launcher, workers) for nothing."""

    def find_spec(self, name, path, target=None):
        if name != "torch.serialization":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            module.register_package(11, _never_tags, _cpu_index_deserializer)

        spec.loader.exec_module = exec_and_register
        return spec


sys.meta_path.insert(0, _AfterTorchSerialization())
_run_next_sitecustomize()
