"""ftlaunch.run.ray: what the Ray engine (`train --engine ray`) is made of.

- ``cluster``: the cluster's nodes (the dashboard's state API) as the planner's ``Hardware``, and
  the preflight of LLaMA-Factory's own Ray mode (its placement group) against them. Pure.
- ``jobs``: the one shell over the Ray Jobs API (``ray.job_submission``) and the dashboard: submit,
  status, logs, stop, nodes; a head that cannot be reached raises ``EngineUnreachable``. The only
  module of ftlaunch that imports ``ray`` (the ``ray`` extra), inside its functions.
- ``record``: ray.json in the run folder: the head's address and one submission id per attempt.
- ``follow``: the follower beside a Ray run (``python -m ftlaunch.run.ray.follow RUN_DIR``): reads
  the job's status, and submits the next attempt when the job failed from outside (its driver
  killed, its node lost), under the restart brake. Its decision is the pure ``next_step``.

The job's entrypoint is ftlaunch's own supervisor for the run (a later attempt: `ftlaunch resume RUN
--foreground`), so the stall, OOM, disk and health guards run beside the trainer on the cluster, as
on a Slurm node. The run folder and the output_dir are on storage the cluster's nodes see.

May import: the ground, ftlaunch.plan and the rest of ftlaunch.run.
"""
