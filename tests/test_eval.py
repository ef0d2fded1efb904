"""Validation during training: a held-out split, evaluated every N steps, the best model kept."""

from __future__ import annotations

import json

import pytest

import bigtune.engine.loop as engine
from bigtune.core.presets import tiny_tokenizer
from bigtune.data.text import build_examples
from bigtune.recipe import DataConfig, RecipeError, load_recipe
from bigtune.run.training import train
from conftest import read_jsonl, tiny_overrides


@pytest.fixture
def unique_data(tmp_path):
    path = tmp_path / "unique.jsonl"
    path.write_text(
        "".join(
            json.dumps({"instruction": f"Say the number {i}.", "input": "", "output": f"The number is {i}."}) + "\n"
            for i in range(100)
        )
    )
    return path


def test_validation_split_is_disjoint_and_seeded(unique_data):
    tok = tiny_tokenizer()
    cfg = DataConfig(source=str(unique_data), val_fraction=0.2)
    train_ex, report = build_examples(cfg, tok, seed=1)
    val_ex = report.val_examples
    assert len(val_ex) == 20 and len(train_ex) == 80 and report.validation == 20
    assert not {tuple(e.input_ids) for e in train_ex} & {tuple(e.input_ids) for e in val_ex}
    again, rep2 = build_examples(cfg, tok, seed=1)
    assert [e.input_ids for e in rep2.val_examples] == [e.input_ids for e in val_ex]


def test_eval_split_never_reaches_a_training_batch(tmp_path, unique_data, monkeypatch):
    seen = []
    real_step = engine.train_step

    def spy(b, batches, *a, **k):
        seen.extend(tuple(row[row != b.tokenizer.pad_token_id].tolist()) for x in batches for row in x["input_ids"])
        return real_step(b, batches, *a, **k)

    monkeypatch.setattr(engine, "train_step", spy)
    s = train(
        {},
        tiny_overrides(
            tmp_path / "r",
            **{
                "data.source": str(unique_data),
                "data.val_fraction": 0.2,
                "train.max_steps": None,
                "train.max_epochs": 2,
                "eval.every_steps": 5,
                "memory.plan": False,
                "checkpoint.save_model": True,
            },
        ),
        quiet_recipe=True,
    )
    val = {
        tuple(e.input_ids)
        for e in build_examples(
            DataConfig(source=str(unique_data), val_fraction=0.2, max_seq_length=64), tiny_tokenizer(), seed=42
        )[1].val_examples
    }
    assert len(seen) == 2 * 80 and not set(seen) & val
    evals = read_jsonl(tmp_path / "r" / "eval.jsonl")
    assert [e["step"] for e in evals] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert all(e["val_tokens"] > 0 and e["eval_peak_allocated"] > 0 for e in evals)
    best = min(evals, key=lambda e: e["val_loss"])
    assert s["eval"]["best_step"] == best["step"]
    assert json.loads((tmp_path / "r" / "best.json").read_text())["step"] == best["step"]
    assert (tmp_path / "r" / "best" / "model.safetensors").is_file()
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]


def test_eval_needs_a_validation_split():
    with pytest.raises(RecipeError) as e:
        load_recipe({}, ["eval.every_steps=10"])
    assert any("data.val_fraction" in p for p in e.value.problems)
