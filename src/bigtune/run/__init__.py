"""One training run end to end: the engine with the planner beside it (plan before, advice after an
out-of-memory, plan vs measured at the end), and launching it on several processes or Slurm.
"""
