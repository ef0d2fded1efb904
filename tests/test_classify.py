"""Text classification: the bundled demo learns, labels are read strictly, predict/eval, LoRA, the planner."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from bigtune.core.metrics import majority_baseline
from bigtune.core.presets import DEMO_CLASSIFICATION_DATA, tiny_tokenizer
from bigtune.core.stepmath import causal_lm_loss_sum
from bigtune.data.labels import LabelMap, build_classification_examples, infer_label_names
from bigtune.data.text import DataError
from bigtune.recipe import DataConfig, RecipeError, load_recipe
from bigtune.run.training import train
from conftest import HANG_GUARD_S, ROOT, run_cli

DEMO = ROOT / "recipes" / "reviews-demo.yaml"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The shipped demo recipe, trained as a user would (CPU, a few seconds)."""
    out = tmp_path_factory.mktemp("cls") / "run"
    torch.set_num_threads(1)
    summary = train(DEMO, {"output_dir": str(out)}, quiet_recipe=True)
    return out, summary


def test_demo_beats_the_majority_class_baseline(demo_run):
    out, summary = demo_run
    assert summary["status"] == "ok"
    # The baseline comes from the data: the same seeded hold-out the run validated on.
    r = load_recipe(DEMO)
    _, report = build_classification_examples(r.data, tiny_tokenizer(), r.seed)
    baseline = majority_baseline([e.labels[0] for e in report.val_examples])
    assert report.validation == summary["data"]["validation"] == 96
    assert baseline < 0.6
    final = summary["eval"]["final"]
    assert final["accuracy"] > baseline + 0.2, (final["accuracy"], baseline)
    assert final["macro_f1"] > 0.6
    cm = final["confusion_matrix"]
    assert len(cm) == 3 and sum(map(sum, cm)) == 96
    # Best checkpoint chosen by the recipe's eval.best_metric (macro_f1), highest wins.
    best = json.loads((out / "best.json").read_text())
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert summary["eval"]["best_metric"] == "macro_f1"
    assert best["macro_f1"] == max(e["macro_f1"] for e in evals) == summary["eval"]["best_value"]
    # Inferred label names land in the run's recipe and the saved model's config.
    saved = load_recipe(out / "recipe.yaml")
    assert saved.data.label_names == ["negative", "neutral", "positive"]
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}
    assert summary["data"]["skipped"] == 2  # the demo's empty text and missing label
    # The measured memory table exists and the planner simulated the classifier head like for like.
    assert (out / "memory.jsonl").is_file()
    assert abs(summary["plan"]["peak_error_pct"]) < 5


def test_predict_writes_labels_and_probabilities(demo_run, tmp_path):
    out, _ = demo_run
    src = tmp_path / "reviews.csv"
    src.write_text(
        'text,id\n"The ramen was delicious!",1\n"My burger was cold and bland.",2\n'
        '"The curry was okay, nothing special",3\n',
        encoding="utf-8",
    )
    res = run_cli("predict", "--model", str(out), str(src), "--out", str(tmp_path / "labels.csv"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    with open(tmp_path / "labels.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["text"] for r in rows] == [
        "The ramen was delicious!",
        "My burger was cold and bland.",
        "The curry was okay, nothing special",
    ]
    assert list(rows[0]) == ["text", "label", "prob_negative", "prob_neutral", "prob_positive"]
    for r in rows:
        probs = {k[5:]: float(v) for k, v in r.items() if k.startswith("prob_")}
        assert abs(sum(probs.values()) - 1) < 1e-4 and r["label"] == max(probs, key=probs.get)
    assert [r["label"] for r in rows] == ["positive", "negative", "neutral"]
    assert not list(tmp_path.glob(".*.tmp"))  # written to a temp file, then renamed


def test_predict_bad_input_is_one_clear_error(demo_run, tmp_path):
    out, _ = demo_run
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "fine"}\n{"review": "no text field"}\n', encoding="utf-8")
    res = run_cli("predict", "--model", str(out), str(src), "--out", str(tmp_path / "o.csv"), cwd=tmp_path)
    assert res.returncode == 2 and "line 2" in res.stderr and "--text-field" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "o.csv").exists()


def test_eval_cli_reports_classification_metrics(demo_run, tmp_path):
    out, _ = demo_run
    res = run_cli("eval", "--model", str(out / "model"), "--data", "demo", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    m = json.loads(res.stdout)
    assert m["samples"] == 480 and m["skipped"] == 2
    assert sum(map(sum, m["confusion_matrix"])) == 480
    assert m["accuracy"] > m["majority_baseline"] == pytest.approx(216 / 480)
    assert set(m["f1_per_class"]) == {"negative", "neutral", "positive"}


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_unknown_label_names_file_line_and_record(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", [{"text": "good", "label": "pos"}, {"text": "bad", "label": "neg"}])
    with f.open("a") as fh:
        fh.write("\n")  # a blank line: the error's line number must still be right
        fh.write(json.dumps({"text": "meh", "label": "neutral"}) + "\n")
    cfg = DataConfig(source=str(f), label_names=["neg", "pos"])
    with pytest.raises(DataError) as e:
        build_classification_examples(cfg, tiny_tokenizer(), 0)
    msg = str(e.value)
    assert str(f) in msg and "record 2" in msg and "line 4" in msg and "'neutral'" in msg and "label_names" in msg


def test_missing_fields_are_skipped_and_counted_or_errors_when_asked(tmp_path):
    f = _jsonl(
        tmp_path / "d.jsonl",
        [{"text": "good", "label": 1}, {"text": "", "label": 0}, {"text": "bad"}, {"text": "ok", "label": 0}],
    )
    ex, rep = build_classification_examples(DataConfig(source=str(f)), tiny_tokenizer(), 0)
    assert len(ex) == 2 and [i for i, _ in rep.skipped] == [1, 2]
    assert rep.label_names == ["0", "1"] and rep.label_counts == {"0": 1, "1": 1}
    with pytest.raises(DataError, match="record 1 .line 2.: empty text"):
        build_classification_examples(DataConfig(source=str(f), skip_bad_records=False), tiny_tokenizer(), 0)


def test_label_inference_and_integer_labels():
    assert infer_label_names([10, 2, 2], "x") == ["2", "10"]  # numbers sort as numbers
    assert infer_label_names(["pos", "neg"], "x") == ["neg", "pos"]
    with pytest.raises(DataError, match="mix"):
        infer_label_names([1, "pos"], "x")
    with pytest.raises(DataError, match="at least 2"):
        infer_label_names(["pos", "pos"], "x")
    sst2 = LabelMap(["negative", "positive"])  # integers index into names...
    assert sst2.index(1) == 1 and sst2.index("negative") == 0 and sst2.index(2) is None
    stars = LabelMap([1, 2, 3, 4, 5])  # ...unless the names are numbers: then they match by name
    assert stars.index(1) == 0 and stars.index(5) == 4 and stars.index(0) is None


def test_recipe_checks_for_classification():
    with pytest.raises(RecipeError) as e:
        load_recipe({}, ["data.format=classification", "eval.best_metric=accuracy", "data.label_names=[a,b]"])
    probs = "\n".join(e.value.problems)
    assert "model.family=sequence-classification" in probs and "eval.best_metric" in probs
    with pytest.raises(RecipeError, match="one per class"):
        load_recipe(DEMO, ["data.label_names=[a,b,c]", "data.class_weights=[1,2]"])
    with pytest.raises(RecipeError, match="sequence-classification preset"):
        load_recipe(DEMO, ["model.family=causal-lm"])


def test_class_weights_scale_each_sample_and_keep_the_sample_count_as_divisor():
    logits = torch.randn(4, 3)
    labels = torch.tensor([0, 2, 2, 1])
    w = torch.tensor([1.0, 2.0, 0.5])
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    assert torch.allclose(causal_lm_loss_sum(logits, labels, shift=False, class_weights=w), (ce * w[labels]).sum())
    assert torch.allclose(causal_lm_loss_sum(logits, labels, shift=False), ce.sum())


def _short(out, **extra):
    base = {
        "output_dir": str(out),
        "train.max_steps": 3,
        "train.max_epochs": None,
        "eval.every_steps": None,
        "data.num_train_samples": 48,
        "memory.plan": False,
    }
    base.update(extra)
    return base


def test_activation_checkpointing_gives_the_same_losses(tmp_path):
    torch.set_num_threads(1)
    a = train(DEMO, _short(tmp_path / "a", **{"checkpoint.save_model": False}), quiet_recipe=True)
    b = train(
        DEMO,
        _short(
            tmp_path / "b",
            **{
                "checkpoint.save_model": False,
                "train.activation_checkpointing": True,
                "data.class_weights": [1.0, 2.0, 1.0],
                "data.label_names": ["negative", "neutral", "positive"],
            },
        ),
        quiet_recipe=True,
    )
    c = train(
        DEMO,
        _short(tmp_path / "c", **{"checkpoint.save_model": False, "train.activation_checkpointing": True}),
        quiet_recipe=True,
    )
    assert a["first_loss"] == pytest.approx(c["first_loss"], rel=1e-5)
    assert a["final_loss"] == pytest.approx(c["final_loss"], rel=1e-4)
    assert b["first_loss"] != pytest.approx(a["first_loss"], rel=1e-3)  # the weights change the loss


def test_lora_classifier_trains_head_and_predicts_from_the_adapter(tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "lora"
    s = train(DEMO, _short(out, **{"peft.method": "lora", "peft.r": 4}), quiet_recipe=True)
    assert s["status"] == "ok"
    assert s["parameters"]["trainable"] < s["parameters"]["total"] / 2
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg["task_type"] == "SEQ_CLS" and sorted(cfg["target_modules"]) == ["query", "value"]
    assert (out / "base" / "config.json").is_file()
    src = _jsonl(tmp_path / "in.jsonl", [{"text": "The soup was delicious."}, {"text": "It was awful."}])
    res = run_cli("predict", "--model", str(out), str(src), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = list(csv.DictReader(res.stdout.splitlines()))
    assert len(rows) == 2 and all(r["label"] in ("negative", "neutral", "positive") for r in rows)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_qlora_classifier_keeps_its_head_unquantized_and_trains(tmp_path):
    torch.set_num_threads(1)
    s = train(
        DEMO,
        _short(
            tmp_path / "q",
            **{"model.quantize": "nf4", "peft.method": "lora", "train.max_steps": 2, "checkpoint.save_model": False},
        ),
        quiet_recipe=True,
    )
    assert s["status"] == "ok" and s["final_loss"] == s["final_loss"]  # finite, not NaN
    assert 0 < s["parameters"]["trainable"] < s["parameters"]["total"]


def test_demo_data_is_reproducible():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_reviews_demo
    finally:
        sys.path.pop(0)
    expected = "".join(json.dumps(r) + "\n" for r in make_reviews_demo.reviews())
    assert DEMO_CLASSIFICATION_DATA.read_text(encoding="utf-8") == expected


def test_sst2_recipe_validates_and_fails_clearly_offline(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    recipe = ROOT / "recipes" / "distilbert-sst2.yaml"
    r = load_recipe(recipe)
    assert r.model.name == "distilbert-base-uncased" and r.model.family == "sequence-classification"
    assert r.data.source == "hf:stanfordnlp/sst2" and (r.data.text_field, r.data.label_field) == ("sentence", "label")
    res = subprocess.run(
        [sys.executable, "-m", "bigtune", "train", str(recipe), "--set", "train.max_steps=1"],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=HANG_GUARD_S,
    )
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.startswith("bigtune: error:") and "Traceback" not in res.stderr
    assert "distilbert-base-uncased" in res.stderr and "local folder" in res.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_ddp_and_fsdp_train_a_classifier_identically(tmp_path):
    """Two CPU ranks: DDP (replicated) and FSDP (sharded) take the same steps, so the same losses."""
    summaries = {}
    for strategy in ("ddp", "fsdp"):
        out = tmp_path / strategy
        res = run_cli(
            "train",
            str(DEMO),
            "--set",
            "devices=2",
            "--set",
            f"strategy={strategy}",
            "--set",
            "train.max_steps=3",
            "--set",
            "train.max_epochs=null",
            "--set",
            "eval.every_steps=3",
            "--set",
            "data.num_train_samples=64",
            "--set",
            "checkpoint.save_model=false",
            "--set",
            f"output_dir={out}",
            cwd=tmp_path,
            timeout=HANG_GUARD_S,
        )
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        summaries[strategy] = json.loads((out / "summary.json").read_text())
    ddp, fsdp = summaries["ddp"], summaries["fsdp"]
    assert ddp["final_loss"] == pytest.approx(fsdp["final_loss"], rel=1e-4)
    assert ddp["eval"]["final"]["accuracy"] == fsdp["eval"]["final"]["accuracy"]
    assert len(fsdp["eval"]["final"]["confusion_matrix"]) == 3
