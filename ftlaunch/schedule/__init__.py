"""ftlaunch.schedule."""
