"""ftlaunch.present: presentation of what the planning core decided (floor 1.25, just above plan/).

Owns how a plan and a machine read for people: the one table rule every table ftlaunch prints
follows (tables: ``Col``/``Grid``/``kv_table``, a grid when every cell fits whole, else stacked,
never cut) and the plan's renderables and plan.txt (render: the changes table, the invariants, the
memory table, the hardware summary, the alternatives when a setup does not fit). No decisions here:
each renderable is a function of a Plan, a Hardware or a MemoryPrediction already made.

May import: the ground (ftlaunch.errors, ftlaunch.files, ftlaunch.locks), ftlaunch.plan (the values
it renders) and rich; never probe/, hub/, run/, estimate/, schedule/ or cli/ (tests/test_layers.py
checks). run/ writes plan.txt with it and cli/ prints with it, so it sits below both. Never torch.
"""
