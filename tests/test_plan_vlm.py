"""bigtune plan for chat vision-language models (Qwen2-VL, Qwen2.5-VL; issue #27): the engine's CPU step
against the plan re-made at the measured batch (image grids included), batches holding images of
different sizes, the depth extrapolation (Qwen2.5-VL's full-attention blocks placed again when the vision
tower shrinks), the worst case at the processor's max_pixels and --image-size. CPU, tiny."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from bigtune.core.presets import preset_config, tiny_qwen_vl_processor
from bigtune.data.images import DEMO_IMAGES
from bigtune.plan.base.target import Target
from bigtune.plan.planner import plan
from bigtune.plan.step.chatvlm import image_geometry
from bigtune.plan.step.simulate import get_depth, model_stacks, simulate
from bigtune.recipe import load_recipe
from bigtune.run.training import train
from conftest import ROOT, read_jsonl, run_cli

DEMO = ROOT / "recipes" / "gourmetgram-qwen2-vl-demo.yaml"
CATEGORIES = ("parameters", "gradients", "optimizer_device", "activations", "allocated", "peak_allocated")


# tiny models gain nothing from intra-op threads on a busy 2-core machine (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def mixed_sizes(tmp_path_factory) -> Path:
    """Photos at two sizes, alternating, captions of different lengths: the bundled 32×32 photos become
    56×56 pixels (4 image tokens), the same photos at 100×80 become 112×84 (12 tokens; several of
    Qwen2.5-VL's attention windows)."""
    return two_size_photos(tmp_path_factory.mktemp("mixed"), (80, 100))


def two_size_photos(folder: Path, other_size: tuple[int, int]) -> Path:
    """An image + caption JSONL of four bundled photos, every second one resized to ``other_size`` (w, h),
    captions of different lengths."""
    from PIL import Image

    rows = []
    for i, photo in enumerate(sorted((DEMO_IMAGES / "images").glob("*.png"))[:4]):
        path = photo
        if i % 2:
            path = folder / f"resized{i}.png"
            Image.open(photo).convert("RGB").resize(other_size).save(path)
        rows.append({"image": str(path), "text": "a plate of food " + "with herbs " * (3 * i)})
    src = folder / "photos.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return src


def _deep_model(tmp_path: Path, preset: str) -> str:
    """A local folder with a deeper config and the preset's processor: Qwen2-VL with 3 vision and 3 text
    layers; Qwen2.5-VL with 6 vision layers, full attention in every second (its unit is two blocks), and
    3 text layers. The planner extrapolates them from shallow simulations; the engine builds them in full."""
    proc = tiny_qwen_vl_processor("Qwen2_5_VLProcessor" if "2.5" in preset else "Qwen2VLProcessor")
    cfg = preset_config(preset, proc)
    if "2.5" in preset:
        cfg.vision_config.depth, cfg.vision_config.fullatt_block_indexes = 6, [1, 3, 5]
    else:
        cfg.vision_config.depth = 3
    cfg.text_config.num_hidden_layers = 3
    cfg.text_config.layer_types = ["full_attention"] * 3
    folder = tmp_path / f"deep-{preset}"
    cfg.save_pretrained(folder)
    proc.save_pretrained(folder)
    return str(folder)


def train_and_compare(run: Path, over: dict) -> dict:
    """Train with the engine re-planning its last measured batch (memory.plan), and check that plan against
    the measurement: the batch shape re-planned, the peak within 2 %, the model states exact and each phase's
    allocated bytes within 2 %. Returns the last measured step's snapshots by phase."""
    s = train(str(DEMO), {**over, "output_dir": str(run)}, quiet_recipe=True)
    last = max(x["step"] for x in read_jsonl(run / "memory.jsonl"))
    steady = {x["phase"]: x for x in read_jsonl(run / "memory.jsonl") if x["step"] == last}
    c = s["plan"]
    assert c["replanned_at_batch_shape"] == steady["before_forward"]["batch_shape"], c.get("replan_error")
    assert abs(c["peak_error_pct"]) < 2, (c["measured_peak_allocated"], c["predicted_peak_allocated_like_for_like"])
    for phase, cats in c["phases"].items():  # the model states exactly, the activations within 2 %
        for cat in ("parameters", "gradients", "optimizer_device"):
            assert cats[cat]["measured"] == cats[cat]["predicted"], (phase, cat, cats[cat])
        got, want = cats["allocated"]["predicted"], cats["allocated"]["measured"]
        assert abs(got - want) <= 0.02 * want, (phase, got, want)
    return steady


MATRIX = [
    # preset, precision, checkpointing, peft, deep
    ("tiny-qwen2-vl", "32-true", False, "none", False),
    ("tiny-qwen2.5-vl", "32-true", False, "none", False),
    ("tiny-qwen2-vl", "bf16-mixed", True, "lora", True),
    ("tiny-qwen2.5-vl", "32-true", False, "none", True),
]


@pytest.mark.parametrize("preset, precision, ckpt, peft, deep", MATRIX)
def test_plan_matches_the_measured_step_with_two_image_sizes(
    tmp_path, mixed_sizes, preset, precision, ckpt, peft, deep
):
    over = {
        "model.name": _deep_model(tmp_path, preset) if deep else preset,
        "data.source": str(mixed_sizes),
        "data.val_fraction": 0.0,
        "train.micro_batch_size": 4,
        "train.max_steps": 3,
        "train.max_epochs": None,
        "memory.every_steps": 1,
        "memory.plan": True,  # the engine re-plans its last measured batch and compares
        "checkpoint.save_model": False,
        "precision": precision,
        "train.activation_checkpointing": ckpt,
        "peft.method": peft,
    }
    if deep:
        over["model.init"] = "random"
    steady = train_and_compare(tmp_path / "run", over)
    grids = steady["before_forward"]["image_grids"]
    assert sorted({tuple(g) for g in grids}) == [(1, 4, 4), (1, 8, 6)]  # two image sizes in the measured batch
    if deep:  # the extrapolation is really exercised: both stacks are deeper than one simulated unit
        r = load_recipe(str(DEMO), over)
        from bigtune.models.configs import resolve_config

        cfg = resolve_config(r)
        stacks = [(st.kind, get_depth(cfg, st)) for st in model_stacks(cfg)]
        assert stacks == ([("window", 3), ("full", 3), ("", 3)] if "2.5" in preset else [("", 3), ("", 3)])


def test_vision_tower_extrapolates_its_window_and_full_attention_blocks_apart():
    """Qwen2.5-VL's full-attention blocks every 8th (the published placement): the extrapolation from
    shallow towers of one window and one full-attention block, and one more of each, equals the step
    simulated with all 32 (28 window, 4 full attention)."""
    from bigtune.plan.step.chatvlm import set_vision_blocks
    from bigtune.plan.step.simulate import simulate_full_depth

    proc = tiny_qwen_vl_processor("Qwen2_5_VLProcessor")
    cfg = preset_config("tiny-qwen2.5-vl", proc)
    cfg.vision_config.depth, cfg.vision_config.fullatt_block_indexes = 32, [7, 15, 23, 31]
    r = load_recipe(str(DEMO), {"model.name": "tiny-qwen2.5-vl", "train.micro_batch_size": 2})
    stacks = model_stacks(cfg)
    assert [(st.kind, get_depth(cfg, st)) for st in stacks] == [("window", 28), ("full", 4), ("", 2)]
    shallow = copy.deepcopy(cfg)
    set_vision_blocks(shallow, "window", 2)  # the full-attention blocks spread as published: each closes its share
    assert (shallow.vision_config.depth, shallow.vision_config.fullatt_block_indexes) == (6, [0, 2, 3, 5])
    full = simulate(r, cfg, {st: get_depth(cfg, st) for st in stacks}, False)
    extrapolated = simulate_full_depth(r, cfg, False)
    assert extrapolated.numel == full.numel
    assert abs(extrapolated.peak_allocated - full.peak_allocated) <= 0.005 * full.peak_allocated


def test_worst_case_is_the_processors_max_pixels_and_image_size_is_planned(tmp_path):
    r = load_recipe(str(DEMO), {"train.micro_batch_size": 2})
    from bigtune.models.configs import resolve_config

    cfg = resolve_config(r)
    geo = image_geometry(r, cfg)
    assert geo.from_processor and (geo.min_pixels, geo.max_pixels) == (56 * 56, 112 * 112)
    assert geo.worst_grid() == (1, 8, 8) and geo.tokens(geo.worst_grid()) == 16
    assert geo.grid(32, 32) == (1, 4, 4) and geo.grid(100, 80) == (1, 8, 6)
    worst = plan(r, Target("cpu"))
    small = plan(r, Target("cpu"), images=(geo.grid(32, 32),))
    assert plan(r, Target("cpu"), images=(geo.worst_grid(),)).peak_allocated == worst.peak_allocated
    # the batch held before the forward: the two rows' pixel tiles (float32, 3 × 2 frames × 14² each)
    tiles = (64 - 16) * 2 * 3 * 2 * 14 * 14 * 4
    assert worst.phases["before_forward"]["activations"] - small.phases["before_forward"]["activations"] >= tiles
    assert any("112×112 px (16 image tokens): the worst case" in n for n in worst.notes)

    res = run_cli("plan", str(DEMO), "--image-size", "32x32", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    p = json.loads(res.stdout)["plan"]
    assert (
        p["peak_allocated"]
        < json.loads(run_cli("plan", str(DEMO), "--json", cwd=tmp_path).stdout)["plan"]["peak_allocated"]
    )
    assert any("56×56 px (4 image tokens)" in n for n in p["notes"])
    bad = run_cli("plan", str(DEMO), "--image-size", "big", cwd=tmp_path)
    assert bad.returncode == 2 and "HEIGHTxWIDTH" in bad.stderr


def test_data_lengths_plan_the_datas_largest_image(mixed_sizes):
    from bigtune.plan.search.lengths import data_lengths, plan_at_data_lengths

    r = load_recipe(str(DEMO), {"data.source": str(mixed_sizes), "data.val_fraction": 0.0, "train.micro_batch_size": 4})
    d = data_lengths(r)
    assert d.largest_image == (1, 8, 6) and d.longest <= r.data.max_seq_length
    p = plan_at_data_lengths(r, Target("cpu"), lengths=d)
    assert any("112×84 px (12 image tokens)" in n for n in p.notes)


# two steps of 4 photos, each measured and compared with the plan (the engine re-plans where the batch differs)
MEASURED_TWO_STEPS = {
    "data.val_fraction": 0.0,
    "train.micro_batch_size": 4,
    "train.max_steps": 2,
    "train.max_epochs": None,
    "memory.every_steps": 1,
    "memory.plan": True,
    "checkpoint.save_model": False,
}


# --- data.image_max_pixels: the pixel budget that bounds the image tokens --------------------------------
BUDGET = 56 * 56  # one 56×56 image: 4 merged 28-px units, 4 image tokens


def test_image_max_pixels_shrinks_the_image_tokens_and_the_plan_follows(tmp_path, mixed_sizes):
    """The 100×80 photos, 112×84 px and 12 image tokens under the processor's 112² bound (the matrix
    above), are scaled to 56×28 px (2 tokens) under a 56² budget; the engine's re-plan of that batch
    stays within 2 %."""
    over = {
        **MEASURED_TWO_STEPS,
        "model.name": "tiny-qwen2-vl",
        "data.source": str(mixed_sizes),
        "data.image_max_pixels": BUDGET,
    }
    steady = train_and_compare(tmp_path / "run", over)
    grids = sorted({tuple(g) for g in steady["before_forward"]["image_grids"]})
    assert grids == [(1, 4, 2), (1, 4, 4)]  # tokens per photo: 2 and 4, against 12 and 4 without the budget


def test_plan_worst_case_follows_image_max_pixels(tmp_path):
    from bigtune.models.configs import resolve_config

    r = load_recipe(str(DEMO), {"train.micro_batch_size": 2, "data.image_max_pixels": BUDGET})
    cfg = resolve_config(r)
    geo = image_geometry(r, cfg)
    assert (geo.min_pixels, geo.max_pixels) == (BUDGET, BUDGET) and geo.max_pixels_from_recipe
    assert geo.worst_grid() == (1, 4, 4) and geo.tokens(geo.worst_grid()) == 4
    assert geo.grid(100, 80) == (1, 4, 2)  # --image-size: that image as the bounded processor resizes it
    bounded = plan(r, Target("cpu"))
    assert any("56×56 px (4 image tokens): the worst case, data.image_max_pixels=3136" in n for n in bounded.notes)
    unbounded = plan(load_recipe(str(DEMO), {"train.micro_batch_size": 2}), Target("cpu"))
    assert bounded.peak_allocated < unbounded.peak_allocated
    res = run_cli("plan", str(DEMO), "--image-size", "100x80", "--set", f"data.image_max_pixels={BUDGET}", cwd=tmp_path)
    assert res.returncode == 0 and "56×28 px (2 image tokens)" in res.stdout, res.stdout + res.stderr


def test_image_max_pixels_bounds_smolvlm_tiles_and_fixed_size_models_refuse_it(tmp_path):
    """Idefics3 (SmolVLM): the budget is the longest edge, rounded down to the 32-px tile: 32² px makes a
    100×80 photo one unsplit image instead of 2×2 tiles and the whole image. LLaVA resizes every image to
    32×32: the key is refused in training and in the plan, naming the fix."""
    from PIL import Image

    from bigtune.data.text import DataError
    from bigtune.data.vlm import ChatImageLayout, bound_image_pixels, image_item
    from bigtune.models.build import load_processor
    from bigtune.models.configs import resolve_config

    r = load_recipe(str(DEMO), {"model.name": "tiny-smolvlm"})
    cfg, proc = resolve_config(r), load_processor(r.model)
    layout = ChatImageLayout.for_model(proc, cfg, r.data.prompt)
    photo = Image.new("RGB", (80, 100))

    def image_tokens() -> int:
        row = image_item(layout, proc.image_processor, photo, layout.prompt_ids, None)
        return row["input_ids"].count(layout.image_token_id)

    whole = image_tokens()
    bound_image_pixels(proc, cfg, 32 * 32 + 100, "tiny-smolvlm")
    assert proc.image_processor.size.longest_edge == 32
    assert image_tokens() * 5 == whole  # the global image alone, against 4 tiles + the global image
    with pytest.raises(DataError, match="below one 32×32 px tile"):
        bound_image_pixels(proc, cfg, 31 * 31, "tiny-smolvlm")

    llava = {"model.name": "tiny-llava", "data.image_max_pixels": BUDGET, "output_dir": str(tmp_path / "run")}
    with pytest.raises(DataError, match=r"resizes every image to 32×32 px; remove data.image_max_pixels"):
        train(str(DEMO), llava, quiet_recipe=True)
    res = run_cli("plan", str(DEMO), "--model", "tiny-llava", "--set", f"data.image_max_pixels={BUDGET}", cwd=tmp_path)
    assert res.returncode == 2 and "tiny-llava (llava) resizes every image to 32×32 px" in res.stderr, res.stderr
    from bigtune.recipe import RecipeError

    with pytest.raises(RecipeError, match="data.image_max_pixels: only image-to-text models read images"):
        load_recipe({}, {"model.name": "tiny-llama", "data.image_max_pixels": BUDGET})


def test_a_measured_batch_of_the_planned_images_compares_with_the_plan_before_training(tmp_path):
    """Photos at the processor's max_pixels (the plan's worst case) and captions past max_seq_length: the
    measured batch is the step the plan simulated, so the engine compares it with that plan instead of
    planning the same step again (for a real chat VLM minutes of CPU), and it is still within 2 %."""
    from PIL import Image

    rows = []
    for i, photo in enumerate(sorted((DEMO_IMAGES / "images").glob("*.png"))[:4]):
        path = tmp_path / f"worst{i}.png"
        Image.open(photo).convert("RGB").resize((112, 112)).save(path)
        rows.append({"image": str(path), "text": "a plate of food with herbs and bread " * 20})
    src = tmp_path / "photos.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    over = {**MEASURED_TWO_STEPS, "data.source": str(src), "output_dir": str(run)}
    r = load_recipe(str(DEMO), over)
    before = plan(r, Target("cpu"))
    assert before.image_grids == [[1, 8, 8]] * 4  # the worst case, one per row
    c = train(str(DEMO), over, quiet_recipe=True)["plan"]
    last = max(x["step"] for x in read_jsonl(run / "memory.jsonl"))
    first = next(x for x in read_jsonl(run / "memory.jsonl") if x["step"] == last and x["phase"] == "before_forward")
    assert first["image_grids"] == before.image_grids and not first["padded"]
    assert first["batch_shape"] == [4, r.data.max_seq_length]
    assert "replanned_at_batch_shape" not in c and "replan_error" not in c
    assert c["predicted_peak_allocated_like_for_like"] == before.peak_allocated
    assert abs(c["peak_error_pct"]) < 2, (c["measured_peak_allocated"], before.peak_allocated)
