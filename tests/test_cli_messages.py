"""What the command line says to a person (issue #42): parse errors at the parser's own line and column,
a bad `--set` value blamed on that `--set`, bounds that say whether the limit itself is allowed, runs named
after the model and data given on the command line, and a plan with one headline figure against the card."""

from __future__ import annotations

import json

import pytest

from bigtune.cli.app import main
from bigtune.recipe import RecipeError, load_recipe
from conftest import ROOT

GOOD = {"instruction": "Say hello to the person reading this, kindly and briefly.", "output": "Hello there!"}


def _bad_record() -> str:
    """One record with a missing comma some way into the line (the parser stops at a column far from 1)."""
    return json.dumps(GOOD)[:-1] + ' "extra" 1}'


def _parser_error(text: str) -> json.JSONDecodeError:
    with pytest.raises(json.JSONDecodeError) as e:
        json.loads(text)
    return e.value


def _error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


# -- defect 6: JSON errors at the parser's line and column -----------------------------------------------------


def test_jsonl_error_names_the_file_line_and_the_column_within_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(GOOD) + "\n\n" + _bad_record() + "\n", encoding="utf-8")
    col = _parser_error(_bad_record()).colno
    assert col > 50
    err = _error(["plan", "--data", str(data), "--data-lengths"], capsys)
    assert f"{data} line 3 column {col}: not valid JSON" in err, err


def test_json_error_names_the_parsers_line_and_column(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "records.json"
    text = "[\n" + json.dumps(GOOD) + ",\n" + _bad_record() + "\n]\n"
    data.write_text(text, encoding="utf-8")
    e = _parser_error(text)
    assert (e.lineno, e.colno) != (3, 1)
    err = _error(["plan", "--data", str(data), "--data-lengths"], capsys)
    assert f"{data} line {e.lineno} column {e.colno}: not valid JSON ({e.msg})" in err, err


def test_jsonl_content_in_a_json_file_is_named_as_such(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "records.json"
    data.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n", encoding="utf-8")
    err = _error(["plan", "--data", str(data), "--data-lengths"], capsys)
    assert "line 2 column 1: not valid JSON (Extra data)" in err and ".jsonl" in err, err


def test_json_recipe_error_is_the_json_parsers_line_and_column(tmp_path):
    text = '{"name": "x",\n "train": {"max_steps": 2 "micro_batch_size": 2}}\n'
    e = _parser_error(text)
    path = tmp_path / "r.json"
    path.write_text(text)
    with pytest.raises(RecipeError) as got:
        load_recipe(path)
    assert got.value.problems == [f"{path} line {e.lineno} column {e.colno}: not valid JSON ({e.msg}); fix the syntax"]


def test_yaml_recipe_error_names_line_and_column(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: x\ntrain:\n  max_steps: 2\n   micro_batch_size: 2\n")
    with pytest.raises(RecipeError) as got:
        load_recipe(path)
    (problem,) = got.value.problems
    assert problem.startswith(f"{path} line 4 column ") and "not valid YAML" in problem, problem


# -- defect 7: a --set value is blamed on that --set; bounds say whether the limit is allowed ------------------


def test_a_bad_set_value_names_that_set_not_the_demo_recipe(capsys):
    err = _error(["recipe", "--set", "optim.lr=-1"], capsys)
    assert "optim.lr: got -1.0; must be ≥ 0 (from --set optim.lr=-1)" in err, err
    assert "demo recipe" not in err


def test_in_a_recipe_file_the_file_is_named_and_the_set_problem_is_tagged(tmp_path, capsys):
    path = tmp_path / "r.yaml"
    path.write_text("name: x\ntrain:\n  max_steps: 0\n")
    err = _error(["recipe", str(path), "--set", "optim.eps=0"], capsys)
    assert f"invalid recipe in {path}" in err
    assert "train.max_steps: got 0; must be ≥ 1\n" in err
    assert "optim.eps: got 0.0; must be > 0 (from --set optim.eps=0)" in err, err


def test_exclusive_and_inclusive_minimums():
    # an inclusive minimum accepts the limit itself: lr 0 trains nothing but is a valid what-if
    assert load_recipe(None, ["optim.lr=0"]).optim.lr == 0.0
    for key in ("optim.eps", "optim.grad_clip", "memory.cap_gib"):
        with pytest.raises(RecipeError) as e:
            load_recipe(None, [f"{key}=0"])
        assert e.value.problems == [f"{key}: got 0.0; must be > 0 (from --set {key}=0)"]
        assert load_recipe(None, [f"{key}=0.5"])


# -- defect 8: --model / --data name the run -------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, data, name",
    [
        ("Qwen/Qwen2.5-7B", None, "qwen2.5-7b"),
        ("Qwen/Qwen2.5-7B", "data/chats.jsonl", "qwen2.5-7b-chats"),
        ("tiny-llama", "hf:tatsu-lab/alpaca", "tiny-llama-alpaca"),
        ("/models/My Model/", "/data/saved-set/", "my-model-saved-set"),
        ("tiny-llama", "demo", "tiny-llama"),
    ],
)
def test_run_name_from_model_and_data(model, data, name):
    from bigtune.recipe import run_name_for

    assert run_name_for(model, data) == name


def test_model_and_data_flags_name_the_resolved_recipe(tmp_path, capsys):
    def name(*argv: str) -> str:
        assert main(["recipe", *argv]) == 0
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("name:"))

    recipe = str(ROOT / "recipes" / "open-llama-7b-full.yaml")
    data = tmp_path / "my-notes.jsonl"
    data.write_text(json.dumps(GOOD) + "\n")
    assert name(recipe) == "name: open-llama-7b-full"
    assert name(recipe, "--model", "Qwen/Qwen2.5-7B") == "name: qwen2.5-7b"
    assert name("--data", str(data)) == "name: tiny-llama-my-notes"  # the demo's model, the data's stem
    assert name(recipe, "--model", "Qwen/Qwen2.5-7B", "--set", "name=mine") == "name: mine"


def test_plan_title_and_run_folder_follow_model(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "tiny-opt"]) == 0
    assert capsys.readouterr().out.startswith("plan: tiny-opt,")
    fast = ["train.max_steps=1", "train.max_epochs=null", "checkpoint.save_model=false", "data.max_seq_length=64"]
    assert main(["train", "--model", "tiny-opt", *(a for s in fast for a in ("--set", s))]) == 0
    assert (tmp_path / "runs" / "tiny-opt" / "summary.json").is_file()
    assert not (tmp_path / "runs" / "demo").exists()


# -- plan output: one headline figure against the card, the breakdown under it, notes by default and --verbose -


METHOD = "FITS/OOM by the 63.59 GiB the replayed allocator needs at least: on a device with less than the reserved"
LONG = "optimizer state in host RAM: 2.00 GiB per process (not in the device peak); " + "detail " * 30


def _plan(capacity_gib: float = 79.11, notes: tuple = (LONG, "time: the GPU waits for Python", METHOD)):
    from bigtune.plan.base.target import Plan

    gib = 2**30
    phase = dict.fromkeys(
        ("parameters", "gradients", "optimizer_device", "optimizer_cpu", "activations", "allocated"), gib
    )
    return Plan(
        recipe_name="open-llama-7b-full",
        target="1× h100-sxm-80gb",
        variant="recipe",
        phases={"after_optimizer": {**phase, "peak_allocated": int(62.82 * gib)}},
        peak_allocated=int(62.82 * gib),
        peak_reserved=int(69.59 * gib),
        overhead=gib // 2,
        peak_total=int(70.09 * gib),
        capacity=int(capacity_gib * gib),
        fits=64.09 <= capacity_gib,
        parameters_total=6_740_000_000,
        step_time_s=0.823,
        tokens_per_s=9949.0,
        tokens_per_step=8192,
        notes=list(notes),
        needed_total=int(64.09 * gib),
    )


def test_plan_headline_is_one_figure_against_the_card():
    from bigtune.plan.format import format_plan

    lines = format_plan(_plan()).splitlines()
    assert lines[:2] == [
        "plan: open-llama-7b-full, 6.74 B parameters",
        "FITS: 64.1 of 79.1 GiB (81 %) on 1× h100-sxm-80gb",
    ]
    text = "\n".join(lines)
    assert "reserved ≈" not in text and "70.09" not in text  # no second total beside the headline
    # the sum under the table adds up to the headline: peak allocated + the allocator's part + context
    assert "  62.82  peak allocated" in lines and "+  0.50  CUDA context (measured on an H200)" in lines
    assert "= 64.09  GiB needed of 79.11 GiB" in lines
    oom = format_plan(_plan(capacity_gib=23.64)).splitlines()[1]
    assert oom == "OOM: 64.1 of 23.6 GiB (271 %) on 1× h100-sxm-80gb"


def test_plan_notes_grouped_short_by_default_and_all_under_verbose():
    from bigtune.plan.format import format_plan

    short = format_plan(_plan())
    assert "memory:\n  - optimizer state in host RAM: 2.00 GiB per process (not in the device peak) …" in short
    assert "time:\n  - the GPU waits for Python" in short
    assert "detail" not in short and METHOD not in short
    assert "1 more notes on how these figures were made" in short and "--verbose" in short
    full = format_plan(_plan(), verbose=True)
    assert LONG in full and METHOD in full and "how these figures were made:" in full
    assert "reserved ≈ 70.09 GiB" in full


def test_plan_verbose_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--gpu", "h100-80gb"]) == 0
    short = capsys.readouterr().out
    assert main(["plan", "--gpu", "h100-80gb", "--verbose"]) == 0
    full = capsys.readouterr().out
    assert short.splitlines()[1].startswith("FITS: 0.") and " of 79.1 GiB (" in short.splitlines()[1], short
    note = "CUDA context 767 MiB outside the allocator"
    assert note in full and note not in short
    assert len(full.splitlines()) > len(short.splitlines())


def test_verbs_that_load_a_model_turn_the_library_bars_off(tmp_path):
    from transformers.utils import logging as hf_logging

    from bigtune.cli.app import main

    hf_logging.enable_progress_bar()
    try:
        assert main(["export", str(tmp_path / "no-such-run")]) != 0
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
