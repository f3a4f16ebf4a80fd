"""ftlaunch.schedule: unattended retraining (floor 5). Cron expressions (cron), the user's crontab
(crontab), the schedule records and their history (records), the command cron runs and its systemd
units (units), version directories, the latest link, pruning and the content hash (versions),
notifications (notify), the use cases `schedule add` / `remove` (manage) and `schedule run`
(runner), and what `schedule list` shows (views).

May import: the ground, ftlaunch.plan, ftlaunch.hub and ftlaunch.run (a scheduled run starts
through ftlaunch.run.launch.start_run, like `train`). Never estimate/ or cli/.
"""
