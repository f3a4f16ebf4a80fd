"""ftlaunch.schedule: unattended retraining (floor 5): cron expressions (cron), the user's
crontab (crontab) and schedules themselves (records, runs, views).

May import: the ground, ftlaunch.plan, ftlaunch.hub and ftlaunch.run (a scheduled run starts
through ftlaunch.run.launch.start_run, like `train`). Never estimate/ or cli/.
"""
