"""ftlaunch.run.slurm."""
