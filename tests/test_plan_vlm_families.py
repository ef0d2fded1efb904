"""bigtune plan for fixed-image vision-language models (LLaVA-1.5, PaliGemma, PaliGemma 2; issue #27): the
engine's CPU step against the plan re-made at the measured batch (rows of different caption lengths, so
padded), the synthetic batch laid out as the collator lays out a real one. CPU, tiny."""

from __future__ import annotations

import pytest

from bigtune.plan.chatvlm import fixed_image_layout
from bigtune.plan.planner import plan
from bigtune.plan.target import Target
from bigtune.recipe import load_recipe
from test_plan_vlm import DEMO, mixed_sizes, one_thread, train_and_compare  # noqa: F401 - fixtures

MATRIX = [
    # preset, precision, checkpointing, peft
    ("tiny-llava", "32-true", False, "none"),
    ("tiny-paligemma", "bf16-mixed", True, "lora"),
    ("tiny-paligemma2", "32-true", False, "none"),
]


@pytest.mark.parametrize("preset, precision, ckpt, peft", MATRIX)
def test_plan_matches_the_measured_step(tmp_path, mixed_sizes, preset, precision, ckpt, peft):  # noqa: F811
    steady = train_and_compare(
        tmp_path / "run",
        {
            "model.name": preset,
            "data.source": str(mixed_sizes),  # every photo resized to the tower's 32 px: 16 image tokens
            "data.val_fraction": 0.0,
            "train.micro_batch_size": 4,
            "train.max_steps": 3,
            "train.max_epochs": None,
            "memory.every_steps": 1,
            "memory.plan": True,
            "checkpoint.save_model": False,
            "precision": precision,
            "train.activation_checkpointing": ckpt,
            "peft.method": peft,
        },
    )
    assert steady["before_forward"]["padded"]  # the captions differ in length


@pytest.mark.parametrize("preset", ["tiny-llava", "tiny-paligemma"])
def test_plan_lays_out_the_collators_batch(preset):
    """The planned batch: the processor's prompt with its placeholder as the config's image tokens, and a
    prefix LM's token types; the plan says how the images were taken."""
    from bigtune.models.configs import resolve_config
    from bigtune.plan.chatvlm import fixed_image_batch

    r = load_recipe(str(DEMO), {"model.name": preset, "train.micro_batch_size": 2})
    cfg = resolve_config(r)
    layout = fixed_image_layout(r, cfg)
    assert layout.from_processor and layout.image_tokens == 16
    batch = fixed_image_batch(r, cfg, layout, 2, padded=True)
    ids = batch["input_ids"]
    assert ids.shape[1] == r.data.max_seq_length - 1 + 16  # the placeholder counted as text, as the data does
    assert int((ids[0] == cfg.image_token_id).sum()) == 16 and batch["pixel_values"].shape == (2, 3, 32, 32)
    answer = batch["labels"][0] != -100
    assert int(answer.sum()) == r.data.max_seq_length - len(layout.prompt_ids)
    if layout.prefix_lm:  # 0 on the image and prompt, 1 on the answer
        assert batch["token_type_ids"][0].tolist() == answer.long().tolist()
    else:
        assert "token_type_ids" not in batch
    p = plan(r, Target("cpu"))
    assert any("resized to 32×32 px (16 image tokens)" in n for n in p.notes), p.notes
