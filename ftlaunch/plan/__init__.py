"""ftlaunch.plan."""
