"""The recipe schema: validation messages, overrides, shipped recipes, generated docs."""

from __future__ import annotations

import pytest

from bigtune.recipe import Recipe, RecipeError, load_recipe, schema_rows, shipped_recipes


def _problems(source=None, overrides=None) -> list[str]:
    with pytest.raises(RecipeError) as e:
        load_recipe(source, overrides)
    return e.value.problems


def test_demo_recipe_loads_and_defaults_are_documented():
    r = load_recipe(None)
    assert r.name == "demo" and r.model.name == "tiny-llama"
    for key, tp, default, doc in schema_rows():
        assert doc.strip(), f"{key} has no documentation"


@pytest.mark.parametrize("path", shipped_recipes(), ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path):
    r = load_recipe(path)
    assert r.name == path.stem
    assert r.global_batch_size >= r.train.micro_batch_size


def test_shipped_recipes_exist():
    names = {p.name for p in shipped_recipes()}
    assert {
        "tinyllama-full.yaml",
        "open-llama-3b-full.yaml",
        "open-llama-7b-full.yaml",
        "open-llama-13b-full.yaml",
    } <= names


def test_misspelled_key_suggests_the_right_one():
    (p,) = _problems({}, ["train.micro_bach_size=8"])
    assert "train.micro_bach_size" in p and "did you mean train.micro_batch_size" in p


def test_misspelled_section_and_choice():
    probs = _problems({"optimm": {"lr": 1}}, ["precision=bf16-tru"])
    assert any("optimm" in p and "did you mean optim" in p for p in probs)
    assert any("precision" in p and "'bf16-true'" in p for p in probs)
    assert len(probs) == 2  # every problem is reported at once


def test_wrong_types_are_named_with_expected_type():
    probs = _problems({}, ["train.max_steps=abc", "optim.lr=fast", "train.activation_checkpointing=3"])
    assert any(p.startswith("train.max_steps: got 'abc'") and "int" in p for p in probs)
    assert any(p.startswith("optim.lr:") and "float" in p for p in probs)
    assert any(p.startswith("train.activation_checkpointing:") and "bool" in p for p in probs)


def test_minimums_are_enforced():
    (p,) = _problems({}, ["train.micro_batch_size=0"])
    assert "must be ≥ 1" in p


def test_overrides_parse_yaml_values():
    r = load_recipe(
        {},
        [
            "optim.lr=1e-3",
            "train.max_steps=7",
            "train.max_epochs=null",
            "model.name=tiny-opt",
            "optim.betas=[0.8, 0.9]",
        ],
    )
    assert r.optim.lr == 1e-3 and r.train.max_steps == 7 and r.train.max_epochs is None
    assert r.model.name == "tiny-opt" and r.optim.betas == [0.8, 0.9]


def test_global_batch_size_derives_accumulation():
    r = load_recipe({}, ["train.micro_batch_size=4", "train.global_batch_size=16"])
    assert r.accumulate == 4 and r.global_batch_size == 16
    (p,) = _problems({}, ["train.micro_batch_size=3", "train.global_batch_size=16"])
    assert "not a multiple" in p


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["precision=16-true", "accelerator=cpu"], "bf16-true"),
        (["precision=16-mixed", "accelerator=cpu"], "bf16-mixed"),
        (["optim.momentum=0.9"], "only SGD"),
        (["devices=2", "strategy=single"], "use strategy=ddp"),
        (
            [
                "strategy=fsdp",
                "devices=2",
                "peft.method=lora",
                "model.quantize=nf4",
                "model.quant_backend=bitsandbytes",
            ],
            "FSDP2 cannot shard bitsandbytes",
        ),
        (["strategy=fsdp", "devices=2", "peft.method=lora", "model.quantize=fp4"], "NF4 only"),
        (["optim.implementation=fused", "accelerator=cpu"], "CUDA"),
        (["model.name=./no/such/folder"], "does not exist"),
        (["data.source=./missing.jsonl"], "does not exist"),
        (["optim.zero_grad=before_backward", "strategy=deepspeed_stage_2"], "optim.zero_grad=after_step"),
    ],
)
def test_incompatible_or_impossible_combinations(overrides, fragment):
    probs = _problems({}, overrides)
    assert any(fragment in p for p in probs), probs


def test_model_folder_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    (p,) = _problems({}, [f"model.name={tmp_path / 'm'}"])
    assert "config.json" in p


def test_yaml_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  micro_batch_size: [1\n")
    (p,) = _problems(bad)
    assert "bad.yaml" in p and "line" in p
    (p,) = _problems(tmp_path / "nope.yaml")
    assert "does not exist" in p


def test_recipe_roundtrips_through_yaml(tmp_path):
    r = load_recipe(None, ["train.micro_batch_size=2"])
    f = tmp_path / "r.yaml"
    f.write_text(r.to_yaml())
    assert load_recipe(f) == r


def test_lab_knobs_are_all_covered():
    keys = {row[0] for row in schema_rows()}
    lab = {
        "model.name",
        "optim.lr",
        "train.micro_batch_size",
        "train.accumulate_grad_batches",
        "precision",
        "optim.name",
        "train.activation_checkpointing",
        "train.max_epochs",
        "train.max_steps",
        "devices",
        "strategy",
        "data.num_workers",
        "train.limit_train_batches",
        "checkpoint.enabled",
        "data.num_train_samples",
        "checkpoint.save_model",
        "optim.warmup_steps",
        "optim.schedule",
        "optim.weight_decay",
        "optim.grad_clip",
        "seed",
        "output_dir",
        "train.global_batch_size",
    }
    assert lab <= keys, lab - keys


def test_recipe_defaults_build_without_arguments():
    r = Recipe()
    assert r.train.micro_batch_size >= 1 and r.optim.name in ("adamw", "sgd")


def test_target_modules_takes_a_plain_string_as_a_list_of_one(tmp_path):
    """`peft.target_modules: all-linear` (PEFT's own string form) and one module name read as a list of one."""
    f = tmp_path / "r.yaml"
    f.write_text("peft:\n  method: lora\n  target_modules: all-linear\n")
    assert load_recipe(f).peft.target_modules == ["all-linear"]
    assert load_recipe({}, {"peft.target_modules": "q_proj"}).peft.target_modules == ["q_proj"]
    with pytest.raises(RecipeError, match="peft.target_modules"):
        load_recipe({}, {"peft.target_modules": 3})
