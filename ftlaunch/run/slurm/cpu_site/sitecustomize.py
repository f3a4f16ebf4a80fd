"""Put on PYTHONPATH of a multi-process CPU trainer (srun-trainer.sh on CPU nodes; docs/slurm.md).

Why: accelerate gives a gloo (MULTI_CPU) process the device ``cpu:0``, and transformers' Trainer
resumes a run with world size > 1 by ``torch.load(optimizer.pt, map_location=args.device)``. torch
turns that device into the location string "cpu:0", which none of its deserializers accepts
("don't know how to restore data location of torch.storage.UntypedStorage (tagged with cpu:0)"),
so every resume of such a run fails. This registers, through torch's public
``torch.serialization.register_package``, a deserializer that takes "cpu:N" as the CPU. It changes
nothing else: saving is untouched (its tagger claims no storage), and other locations fall through.
"""

import re

_CPU_N = re.compile(r"cpu:\d+")


def _cpu_index_deserializer(obj, location):
    if isinstance(location, str) and _CPU_N.fullmatch(location):
        return obj  # torch.load reads storages onto the CPU before it restores their location
    return None


def _never_tags(_obj):
    return None


try:
    import torch.serialization
except Exception:  # noqa: BLE001 - no torch here: nothing to fix, never stop the interpreter
    pass
else:
    torch.serialization.register_package(11, _never_tags, _cpu_index_deserializer)
