"""`python -m ftlaunch`: the command line."""

from .cli import main

main()
