"""ftlaunch.run.slurm: a run as a Slurm batch job: sbatch script and Slurm queries (sbatch),
the batch step (job: `python -m ftlaunch.run.slurm.job RUN_DIR`) and `train --slurm` (submit).

May import: the ground, ftlaunch.plan, ftlaunch.hub and the rest of ftlaunch.run.
"""
