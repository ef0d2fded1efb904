"""FSDP2 with CPUOffloadPolicy (fsdp_cpu_offload) on GPUs: the parameter, gradient and optimizer-state
shards live in host RAM, so the device holds the gathered units and the step's transients only; the
time adds the CPU update and the PCIe copies that compute does not hide."""

from __future__ import annotations

import pytest

from bigtune.core.gpus import find_gpu
from bigtune.plan.base.target import Target
from bigtune.plan.layout.sharding import shard_layout
from bigtune.plan.planner import plan
from bigtune.recipe import load_recipe
from conftest import ROOT

LORA_7B = {
    "peft.method": "lora",
    "train.activation_checkpointing": True,
    "precision": "bf16-true",
    "accelerator": "cpu",
    "strategy": "fsdp",
}


def _plan(offload: bool, **over):
    r = load_recipe(ROOT / "recipes" / "open-llama-7b-full.yaml", {**LORA_7B, "fsdp_cpu_offload": offload, **over})
    return plan(r, Target("cuda", find_gpu("rtx-4090"), 2, "fsdp"), replay=False)


def test_layout_moves_every_fsdp_shard_to_the_host():
    states = {"parameters", "gradients", "optimizer_device"}
    assert shard_layout("fsdp", fsdp_cpu_offload=True) == (states, states)
    assert shard_layout("fsdp") == (states, set())


def test_offloaded_shards_leave_the_device():
    kept, off = _plan(False), _plan(True)
    for phase in ("before_forward", "after_optimizer"):
        assert off.phases[phase]["parameters"] == 0 and off.phases[phase]["gradients"] == 0
        assert off.phases[phase]["optimizer_device"] == 0
    shards = sum(kept.phases["after_backward"][c] for c in ("parameters", "gradients", "optimizer_device"))
    # the device saves at least the shards it no longer holds at the backward's end (bf16 7B: 6.3 GiB)
    assert kept.peak_allocated - off.peak_allocated >= 0.9 * kept.phases["before_forward"]["parameters"]
    assert off.phases["after_backward"]["allocated"] <= kept.phases["after_backward"]["allocated"] - shards
    assert off.phases["after_optimizer"]["optimizer_cpu"] == pytest.approx(
        kept.phases["after_optimizer"]["optimizer_device"], rel=1e-6
    )
    assert any("fsdp_cpu_offload" in n and "pinned host RAM" in n for n in off.notes)
    assert off.step_time_s > kept.step_time_s  # the CPU update and the PCIe copies compute does not hide


def test_a_run_that_only_fits_with_offload_is_planned_to_fit():
    # A full bf16 fine-tune of 7B with AdamW on 2 x 24 GB: each rank's shards of the weights, gradients
    # and Adam state (about 27 GB) do not fit on its card; in host RAM they leave the card to the step.
    over = {"peft.method": "none", "train.micro_batch_size": 2}
    assert not _plan(False, **over).fits
    assert _plan(True, **over).fits
