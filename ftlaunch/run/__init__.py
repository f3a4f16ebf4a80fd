"""ftlaunch.run."""
