"""ftlaunch.probe: the hardware shells (floor 1.5, between the pure plan/ and hub/).

Owns reading this machine without torch: the probe that makes a ``Hardware`` value (NVML, then
``nvidia-smi``, then "no GPU", each failure said in its notes; host RAM, disk, versions), reading a
hardware file written by ``ftlaunch env --json`` (hardware), and the runtime sampler of the GPU
memory a run's processes hold (usage). The values and the parsers they feed stay pure in
ftlaunch.plan.hardware.

May import: the ground (ftlaunch.errors, ftlaunch.files, ftlaunch.locks) and ftlaunch.plan. Never
hub/, run/, estimate/, schedule/ or cli/ (tests/test_layers.py checks). Never torch.
"""
