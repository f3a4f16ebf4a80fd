"""ftlaunch.plan.memory: the GPU-memory model of a training step and the micro-batch choice built on it.

Owns: the training setup read from a config (setup), the model states per GPU (states), the
activations of one micro-batch (activations), the step's peak (peak: ``estimate``), the verdict
and micro-batch choice (choose), the answer as values with plan.json's shape (prediction:
``MemoryPrediction``, ``Verdict``, ``Alternative``), the planner's memory callback (adapt), what
worked before per config and card (store: a small JSON file under the ftlaunch home) and the
simulator with its
child process ``python -m ftlaunch.plan.memory.simulate`` (simulate: the only module that imports
torch, and only in that child).

Pure formulas over a model's shape and the training setup. May import: the ground and ftlaunch.plan.
"""
