"""Task metrics come from maintained libraries; bigtune only arranges their inputs. Plus the caption eval path."""

from __future__ import annotations

import json

import pytest
import torch

from bigtune.core.metrics import caption_metrics, classification_metrics, length_stats, majority_baseline
from conftest import ROOT, run_cli


def test_classification_metrics_on_a_worked_example():
    m = classification_metrics([0, 0, 1, 2], [0, 1, 1, 2], ["a", "b", "c"])
    assert m["accuracy"] == 0.75
    assert m["confusion_matrix"] == [[1, 1, 0], [0, 1, 0], [0, 0, 1]]
    # F1: a: p 1, r 1/2 -> 2/3; b: p 1/2, r 1 -> 2/3; c: 1. Macro = mean.
    assert m["f1_per_class"] == pytest.approx({"a": 2 / 3, "b": 2 / 3, "c": 1.0})
    assert m["macro_f1"] == pytest.approx((2 / 3 + 2 / 3 + 1) / 3)
    # A class that never occurs still gets a row and column (and F1 0, not an exception).
    m = classification_metrics([0, 0], [0, 0], ["a", "b"])
    assert m["confusion_matrix"] == [[2, 0], [0, 0]] and m["macro_f1"] == pytest.approx(0.5)
    assert majority_baseline([0, 1, 1, 2]) == 0.5


def test_caption_metrics_bounds_and_multiple_references():
    refs = [["a bowl of soup on a table"], ["a plate of rice", "rice on a white plate"]]
    perfect = caption_metrics(["a bowl of soup on a table", "a plate of rice"], refs)
    assert perfect["bleu"] == pytest.approx(100.0) and perfect["rouge_l"] == pytest.approx(1.0)
    assert perfect["references_per_caption"] == 1.5
    disjoint = caption_metrics(["zebra xylophone quartz", "velvet kiwi jump"], refs)
    assert disjoint["bleu"] == pytest.approx(0.0) and disjoint["rouge_l"] == 0.0
    # The second reference counts: matching it exactly is as good as matching the first.
    second = caption_metrics(["a bowl of soup on a table", "rice on a white plate"], refs)
    assert second["rouge_l"] == pytest.approx(1.0) and second["bleu"] == pytest.approx(100.0)
    partial = caption_metrics(["a bowl of soup", "a plate of beans"], refs)
    assert 0 < partial["bleu"] < 100 and 0 < partial["rouge_l"] < 1
    assert partial["caption_length_words"] == {"mean": 4.0, "median": 4.0, "min": 4, "max": 4}
    with pytest.raises(ValueError, match="reference"):
        caption_metrics(["x"], [[]])


def test_caption_bleu_is_sacrebleus_corpus_bleu():
    import sacrebleu

    hyps = ["a bowl of soup on the table", "fried eggs on a plate"]
    refs = [["a bowl of soup on a table", "soup in a bowl"], ["two fried eggs on a dark plate", None]]
    ours = caption_metrics(hyps, [["a bowl of soup on a table", "soup in a bowl"], ["two fried eggs on a dark plate"]])
    # sacrebleu's own reference streams (the second image has one reference)
    theirs = sacrebleu.corpus_bleu(hyps, [[refs[0][0], refs[1][0]], [refs[0][1], refs[1][1]]])
    assert ours["bleu"] == pytest.approx(theirs.score)
    assert length_stats([]) == {"mean": None, "median": None, "min": None, "max": None}


def test_eval_cli_scores_an_image_to_text_run(tmp_path):
    from bigtune.run.training import train

    torch.set_num_threads(1)
    run = tmp_path / "cap"
    s = train(
        ROOT / "recipes" / "gourmetgram-demo.yaml",
        {
            "output_dir": str(run),
            "train.max_steps": 1,
            "train.max_epochs": None,
            "data.val_fraction": 0.0,
            "data.num_train_samples": 16,
            "memory.plan": False,
            "memory.enabled": False,
        },
        quiet_recipe=True,
    )
    assert s["status"] == "ok"
    images = ROOT / "src" / "bigtune" / "assets" / "gourmetgram_demo" / "images"
    data = tmp_path / "refs.jsonl"
    rows = [
        {"image": str(images / "0000.png"), "text": "rice in a bowl"},
        {"image": str(images / "0000.png"), "text": "a bowl of rice on a wooden table"},
        {"image": str(images / "0001.png"), "text": "strawberries on a plate"},
        {"image": str(images / "0002.png"), "text": ""},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    res = run_cli("eval", "--model", str(run), "--data", str(data), "--max-new-tokens", "6", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    m = json.loads(res.stdout)
    assert m["images"] == 2 and m["captions"] == 2 and m["skipped_records"] == 1
    assert m["references_per_caption"] == 1.5
    assert 0 <= m["bleu"] <= 100 and 0 <= m["rouge_l"] <= 1
    assert 1 <= m["caption_length_words"]["max"] <= 6
    assert m["bleu_signature"].startswith("nrefs:")
