"""Run `bigtune <args>` with DeepSpeed on the CPU (gloo), for tests on machines without a GPU.

DeepSpeed itself runs ZeRO on its CPU accelerator; only Lightning Fabric's DeepSpeedStrategy (and
bigtune's recipe check, which mirrors it) refuse the CPU. This lifts exactly those guards, so the
rest — DeepSpeed's config parsing, engine, ZeRO partitioning, offload, CPU Adam, checkpoints — is
the real code path. Usage: python tests/deepspeed_on_cpu.py train --set strategy=deepspeed_stage_2 ...
"""

from __future__ import annotations

import sys
from unittest import mock

import torch


def main(argv: list[str]) -> int:
    import lightning.fabric.strategies.deepspeed as lds
    from lightning.fabric.strategies.ddp import DDPStrategy

    import bigtune.recipe as recipe
    from bigtune.cli.app import main as cli_main

    check = recipe.check_deepspeed

    def without_cuda_rule(r, accel):
        return [p for p in check(r, accel) if "needs CUDA GPUs" not in p]

    patches = [
        # Fabric: "only supported on CUDA GPUs" -> the plain DDP environment setup.
        mock.patch.object(lds.DeepSpeedStrategy, "setup_environment", DDPStrategy.setup_environment),
        mock.patch.object(lds, "_validate_device_index_selection", lambda devices: None),
        # deepspeed.initialize wants a device index; the CPU has none in torch's naming.
        mock.patch.object(
            lds.DeepSpeedStrategy, "root_device", property(lambda self: torch.device("cpu", self.local_rank))
        ),
        mock.patch.object(recipe, "check_deepspeed", without_cuda_rule),
    ]
    for p in patches:
        p.start()
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
