"""ftlaunch.estimate: what a fine-tune will cost before it runs (floor 4).

Owns token counting (probe, count_child: llamafactory's own preprocessing in a child process),
lengths and padding (padding), throughput from a probe or from peak FLOP/s (throughput), the
estimate itself (core: steps, time, GPU-hours, levers), the model's facts on a plan (facts: shape,
peak FLOP/s, whether checkpointing off fits), machine comparisons (compare: prices, rows, order) and
the use cases the command line calls (usecase: estimate one machine, compare several; history:
a run's logged steps split into attempts, for `plot`).

May import: the ground, ftlaunch.plan, ftlaunch.hub and ftlaunch.run. Never schedule/ or cli/.
"""
