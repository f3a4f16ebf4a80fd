"""ftlaunch.cli: the command line (the top floor). Each command parses, calls one use case,
renders and maps errors to exit codes; no decision lives here.

Owns the click group, its exit codes and the passthrough commands (main); the commands by what they
touch: plan_cmds (plan, env, download), run_cmds (train, runs, status, logs, stop, resume), estimate,
plot (and the matplotlib drawings), schedule; following a run's log (follow); the option sets shared
by commands (options); the consoles and tables (render).

May import every floor below: the ground, plan, hub, run, estimate and schedule.
"""
