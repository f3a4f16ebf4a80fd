"""`python -m ftlaunch`: the command line."""

from ftlaunch.cli.main import main

main()
