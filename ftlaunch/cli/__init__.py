"""ftlaunch.cli."""
