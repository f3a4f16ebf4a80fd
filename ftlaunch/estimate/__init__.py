"""ftlaunch.estimate."""
