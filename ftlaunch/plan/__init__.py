"""ftlaunch.plan: the pure planning core (floor 1, just above the ground).

Owns what a plan is and how it is made: reading and validating LLaMA-Factory configs (config,
against the key schema config and v1 share: keyschema), what a machine has (hardware: values,
catalog machines, several alike nodes, parsers; the probe is in ftlaunch.probe; the GPU catalog
itself: catalog), how a value reads as a flag (flags), a model's exact shape (modelspec), the
GPU-memory model, micro-batch chooser, memory store and simulator (memory/), the one
``Change`` type (change), the one ZeRO-3 offload rule (offload), the batch arithmetic (batch), the
planner itself (planner: config + hardware + options -> Plan), the final plan step that turns what
the shells found (resolved paths, pre-downloaded model and datasets, the run it is for) into Changes
(prepared, with dataset_info.json's names in datainfo). Rendering a plan is ftlaunch.present's.
Decisions are functions over data; the only shells here are the readers tests/test_purity.py lists:
the config loader, the model config.json readers, the memory store and the simulator's child process.

May import: the ground (ftlaunch.errors, ftlaunch.files, ftlaunch.locks) and itself. Never
hub/, run/, estimate/, schedule/ or cli/ (tests/test_layers.py checks). Never torch.
"""
