"""ftlaunch.plan.memory: the GPU-memory model of a training step and the micro-batch choice built on it.

Pure formulas over a model's shape and the training setup. May import: the ground and ftlaunch.plan.
"""
