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


# Four food captions, their references, and what pycocoevalcap 1.2's CiderScorer (n=4, sigma=6, the COCO
# evaluation's CIDEr-D) printed for the same tokenised strings on 2026-11-25: the corpus mean and each image's.
CIDER_PREDS = ["a bowl of soup on a table", "a plate of rice with beans", "grilled fish and lemon", "a cup of coffee"]
CIDER_REFS = [
    ["a bowl of tomato soup on a wooden table", "soup in a white bowl"],
    ["rice and black beans on a plate", "a plate of rice"],
    ["grilled salmon with a slice of lemon", "fish on a grill", "a lemon and fish"],
    ["a cup of black coffee on a saucer"],
]
PYCOCOEVALCAP_CIDER = 2.8952005248219734
PYCOCOEVALCAP_PER_IMAGE = [2.597960847269625, 4.50580244751494, 1.3851030341381056, 3.0919357703652213]


def test_cider_d_equals_the_coco_reference_implementation():
    from bigtune.core.metrics import cider_d

    assert cider_d(CIDER_PREDS, CIDER_REFS) == pytest.approx(PYCOCOEVALCAP_CIDER, rel=1e-12)
    # the per-image scores too: the document frequencies come from the whole corpus, so score one image
    # by subtracting the others' contribution from the corpus sum
    total = 4 * cider_d(CIDER_PREDS, CIDER_REFS)
    swapped = list(CIDER_PREDS)
    swapped[1] = "zebra xylophone"  # shares no n-gram with its references: that image scores 0
    without_second = 4 * cider_d(swapped, CIDER_REFS)
    assert total - without_second == pytest.approx(PYCOCOEVALCAP_PER_IMAGE[1], rel=1e-9)


def test_cider_d_properties_and_its_place_in_caption_metrics():
    from bigtune.core.metrics import caption_tokens, cider_d

    assert caption_tokens("A bowl of Soup, on a table. Don't!") == [
        "a",
        "bowl",
        "of",
        "soup",
        "on",
        "a",
        "table",
        "don't",
    ]
    # punctuation and case do not change the score
    shouted = [p.upper() + "!" for p in CIDER_PREDS]
    assert cider_d(shouted, CIDER_REFS) == pytest.approx(cider_d(CIDER_PREDS, CIDER_REFS))
    # clipping: repeating a matching word does not raise the score
    assert cider_d(["soup soup soup soup", *CIDER_PREDS[1:]], CIDER_REFS) < cider_d(CIDER_PREDS, CIDER_REFS)
    disjoint = cider_d(["zebra", "xylophone", "quartz", "velvet"], CIDER_REFS)
    assert disjoint == 0.0
    m = caption_metrics(CIDER_PREDS, CIDER_REFS)
    assert m["cider_d"] == pytest.approx(PYCOCOEVALCAP_CIDER)
    # one image: every n-gram is in every reference set, so CIDEr has no weights; it is not reported
    assert caption_metrics(CIDER_PREDS[:1], CIDER_REFS[:1])["cider_d"] is None
