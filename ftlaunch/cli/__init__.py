"""ftlaunch.cli: the command line (the top floor). Each command parses, calls one use case,
renders and maps errors to exit codes; no decision lives here.

Owns the click group (main), the option sets shared by commands (options), the console and the
tables of runs (render), and the estimate/plot and schedule command groups.

May import every floor below: the ground, plan, hub, run, estimate and schedule.
"""
