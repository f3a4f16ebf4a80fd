"""ftlaunch.plan.memory."""
