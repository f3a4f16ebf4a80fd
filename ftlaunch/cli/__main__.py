"""`python -m ftlaunch.cli`: the command line, as crontab lines written by ftlaunch 0.1 before the
package split call it (`python -m ftlaunch.cli schedule run NAME`); new lines use `python -m ftlaunch`."""

from ftlaunch.cli.main import main

main()
