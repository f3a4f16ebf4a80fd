"""ftlaunch.run: one run's life (floor 3): prepare, create, supervise, recover, observe, stop, resume.

Owns the run's typed state (state: RunState, RunStatus, FailureKind; staterecords: its typed sub-
records and the engine's job; policy: RecoveryPolicy and the Budget it spends), the run's event
names (events: Event), the run store (store: one directory per run, state.json read and written
atomically, events.jsonl; only the journal and transitions, its named transitions, write them),
preparing a plan for a run (prepare), claiming the output_dir (outdir), the one launch use case
(launch.start_run, used by `train` and `schedule run`; launch.supervise, used by `resume` too), the
supervisor and its decisions (supervisor, recovery, health, rollback), what the supervisor records
(journal), reading what the trainer writes (progress; tail: new lines of a growing log; checkpoints:
the checkpoint watch), run accounting (accounting: attempts, rates, GPU-hours), the status view
(runview: what it shows, decided purely; view: the shell that looks, and find_run), stop/resume/edit
(control), processes (procs), the trainer's command line (trainer), the engines (engines/: local,
slurm, ray; slurm/ and ray/ their machinery) and the supervisor's watches (watch/).

May import: the ground, ftlaunch.plan and ftlaunch.hub. Never estimate/, schedule/ or cli/.
"""
