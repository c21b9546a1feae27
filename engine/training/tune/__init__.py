"""``pipecast tune``: measure a config's costs, rank the schedules, recommend one."""
