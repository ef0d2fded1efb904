"""The training engine: Fabric set-up, strategies (DDP, FSDP2, DeepSpeed), optimizers, the loop, its
log-window meter and checkpoints. It measures; it does not plan (``bigtune.run`` adds the planner).
"""
