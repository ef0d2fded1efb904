"""bigtune plan for fixed-image vision-language models (LLaVA-1.5, PaliGemma, PaliGemma 2; issue #27): the
engine's CPU step against the plan re-made at the measured batch (rows of different caption lengths, so
padded), the synthetic batch laid out as the collator lays out a real one. CPU, tiny."""

from __future__ import annotations

import pytest

from bigtune.plan.base.target import Target
from bigtune.plan.planner import plan
from bigtune.plan.step.chatvlm import fixed_image_layout
from bigtune.recipe import load_recipe
from conftest import run_cli
from test_plan_vlm import DEMO, mixed_sizes, train_and_compare, two_size_photos  # noqa: F401 - fixtures

# tiny models gain nothing from intra-op threads on a busy 2-core machine (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")

# 3 steps of 4 photos on the given data, every step measured and re-planned at its batch
MEASURED_STEPS = {
    "data.val_fraction": 0.0,
    "train.micro_batch_size": 4,
    "train.max_steps": 3,
    "train.max_epochs": None,
    "memory.every_steps": 1,
    "memory.plan": True,
    "checkpoint.save_model": False,
}

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
            **MEASURED_STEPS,
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
    from bigtune.plan.step.chatvlm import fixed_image_batch

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


@pytest.fixture(scope="module")
def tiled_sizes(tmp_path_factory):
    """Photos SmolVLM's tiny processor (64 px longest edge, 32 px tiles) splits differently, alternating: the
    bundled 32×32 ones into 2×2 tiles + the whole image, the same photos at 30×90 into 1×2 tiles + the whole
    image (so the collator pads those rows with two all-zero images); captions of different lengths."""
    return two_size_photos(tmp_path_factory.mktemp("tiled"), (90, 30))


def test_smolvlm_plan_matches_the_measured_step_with_two_tile_grids(tmp_path, tiled_sizes):
    """Idefics3 (SmolVLM): the re-plan lays out each row's tile grid from memory.jsonl, padding images
    included (found from pixel_attention_mask; the fake pixels have no zeros to test)."""
    steady = train_and_compare(
        tmp_path / "run",
        {
            "model.name": "tiny-smolvlm",
            "data.source": str(tiled_sizes),
            **MEASURED_STEPS,
            "peft.method": "lora",
        },
    )
    assert sorted({tuple(g) for g in steady["before_forward"]["image_grids"]}) == [(1, 2), (2, 2)]


def test_smolvlm_worst_case_is_the_largest_tile_grid_and_image_size_is_planned(tmp_path):
    from bigtune.models.configs import resolve_config
    from bigtune.plan.step.chatvlm import split_geometry

    r = load_recipe(str(DEMO), {"model.name": "tiny-smolvlm", "train.micro_batch_size": 2})
    geo = split_geometry(r, resolve_config(r))
    assert geo.from_processor and (geo.longest_edge, geo.tile, geo.tile_tokens) == (64, 32, 4)
    assert geo.worst_grid() == (2, 2) and geo.grid(30, 90) == (1, 2)
    worst = plan(r, Target("cpu"))
    assert any("2×2 tiles of 32 px + the whole image (34 image tokens): the worst case" in n for n in worst.notes)
    small = plan(r, Target("cpu"), images=(geo.grid(30, 90),))
    assert small.peak_allocated < worst.peak_allocated
    budget = load_recipe(str(DEMO), {"model.name": "tiny-smolvlm", "data.image_max_pixels": 32 * 32})
    assert split_geometry(budget, resolve_config(budget)).worst_grid() == (0, 0)  # one unsplit image
    res = run_cli("plan", str(DEMO), "--model", "tiny-smolvlm", "--image-size", "30x90", cwd=tmp_path)
    assert res.returncode == 0 and "1×2 tiles of 32 px + the whole image" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("precision, ckpt, peft", [("32-true", False, "none"), ("bf16-mixed", True, "lora")])
def test_llava_next_plan_matches_the_measured_step_with_two_aspect_ratios(tmp_path, tiled_sizes, precision, ckpt, peft):
    """LLaVA-NeXT (anyres): the square photos fit 1×2 tiles (36 image tokens), the 30×90 ones 1×3 tiles (68
    tokens); the re-plan lays out each row's image from the sizes memory.jsonl records (image_sizes), its
    tiles padded to the batch's most, as the collator pads them."""
    steady = train_and_compare(
        tmp_path / "run",
        {
            "model.name": "tiny-llava-next",
            "data.source": str(tiled_sizes),
            **MEASURED_STEPS,
            "precision": precision,
            "train.activation_checkpointing": ckpt,
            "peft.method": peft,
        },
    )
    assert sorted({tuple(g) for g in steady["before_forward"]["image_grids"]}) == [(30, 90), (32, 32)]
    assert steady["before_forward"]["padded"]


def test_llava_next_worst_case_is_the_largest_pinpoint_and_image_size_is_planned(tmp_path):
    from bigtune.models.configs import resolve_config
    from bigtune.plan.step.chatvlm import anyres_batch, anyres_geometry

    r = load_recipe(str(DEMO), {"model.name": "tiny-llava-next", "train.micro_batch_size": 2})
    cfg = resolve_config(r)
    geo = anyres_geometry(r, cfg)
    assert geo.from_processor and geo.tiles.worst_size() == (64, 64) and geo.tiles.tokens(64, 64) == 88
    batch = anyres_batch(r, cfg, geo, 2, padded=False, images=((32, 32), (30, 90)))
    assert batch["pixel_values"].shape == (2, 4, 3, 32, 32) and batch["image_sizes"].tolist() == [[32, 32], [30, 90]]
    assert [int((row == cfg.image_token_id).sum()) for row in batch["input_ids"]] == [36, 68]
    assert batch["padded"] and batch["image_tokens"] == 68
    worst = plan(r, Target("cpu"))
    assert any("2×2 tiles of 32 px + the whole image (88 image tokens): the worst case" in n for n in worst.notes)
    small = plan(r, Target("cpu"), images=((32, 32),))
    assert small.peak_allocated < worst.peak_allocated
    res = run_cli("plan", str(DEMO), "--model", "tiny-llava-next", "--image-size", "30x90", cwd=tmp_path)
    assert res.returncode == 0 and "30×90 px: 1×3 tiles of 32 px + the whole image (68" in res.stdout, res.stdout
    bad = run_cli("plan", str(DEMO), "--model", "tiny-llava-next", "--set", "data.image_max_pixels=4096", cwd=tmp_path)
    assert bad.returncode == 2 and "image_grid_pinpoints" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
