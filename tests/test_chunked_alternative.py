"""--alternatives offers the chunked loss where the logits of a large vocabulary are the peak."""

from __future__ import annotations

from bigtune.core.gpus import find_gpu
from bigtune.plan.base.constants import CUDA_CONTEXT_BYTES, FIT_UNCERTAINTY
from bigtune.plan.base.target import Target
from bigtune.plan.planner import plan
from bigtune.plan.search.alternatives import alternatives
from bigtune.plan.step.simulate import device_peak
from bigtune.recipe import load_recipe
from conftest import ROOT

QWEN = {  # 152k vocabulary: 4 × 2048 tokens of fp32 logits are 4.6 GiB before their copies for the loss
    "model.name": "Qwen/Qwen2.5-1.5B",
    "precision": "bf16-true",
    "train.micro_batch_size": 4,
    "train.accumulate_grad_batches": 4,
    "data.max_seq_length": 2048,
    "accelerator": "cpu",
}


def test_chunked_loss_is_offered_and_planned_lower():
    target = Target("cuda", find_gpu("l4"))
    r = load_recipe({}, QWEN)
    sims: dict = {}
    alts = alternatives(r, target, max_gpus=1, workers=1, sims=sims)
    # Steps whose shallow replays disagree are replayed deeper, except where the peak allocated alone (+ the
    # context and cuBLAS workspaces) is over the card: those do not fit whatever the replay says
    deepened = [s for s in sims.values() if s.replay_spread == 0 and "blocks deep, extrapolated" in s.replay]
    skipped = [s for s in sims.values() if s.replay_spread > FIT_UNCERTAINTY]
    assert deepened and skipped
    workspaces = 2 * 8 * 2**20
    assert all(
        device_peak(s.phases, s.peak_allocated) + CUDA_CONTEXT_BYTES + workspaces > target.capacity_bytes
        for s in skipped
    )
    chunked = [a for a in alts if a.overrides.get("train.loss_chunk_tokens")]
    assert len(chunked) == 1 and "chunked loss" in chunked[0].variant and chunked[0].fits
    # its shallow replays disagree (the 152k-vocabulary loss's segments are reused at one depth, not the other):
    # it gets the deeper replay the recipe's own plan would
    assert any("4 and 8 blocks deep" in n for n in chunked[0].notes), chunked[0].notes
    ckpt_only = plan(load_recipe({}, {**QWEN, "train.activation_checkpointing": True}), target, replay=False)
    assert not ckpt_only.fits  # checkpointing alone leaves the logits: the chunked loss is what makes it fit
    assert chunked[0].peak_allocated < ckpt_only.peak_allocated - 4 * 2**30


def test_no_chunked_variant_where_it_does_not_apply():
    # BLIP-2 computes its own loss; a recipe that already chunks needs no variant either.
    target = Target("cuda", find_gpu("l4"))
    blip2 = load_recipe(ROOT / "recipes" / "gourmetgram-demo.yaml", {"accelerator": "cpu"})
    chunking = load_recipe({}, {"train.loss_chunk_tokens": 512, "accelerator": "cpu"})
    for r in (blip2, chunking):
        assert not [a for a in alternatives(r, target, max_gpus=1, workers=1) if "chunked" in a.variant]
    assert [
        a for a in alternatives(load_recipe({}, {"accelerator": "cpu"}), target, max_gpus=1) if "chunked" in a.variant
    ]
