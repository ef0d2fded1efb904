"""Several sources in one run (data.sources): weights, the per-source held-out split, errors naming the entry.

Offline: the bundled tiny tokenizer and files written under tmp_path. Which source a mixed example came from
is told by its tokens (each source built alone gives the set to look it up in), not by the report's counts.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from bigtune.core.presets import tiny_tokenizer
from bigtune.data.text import DataError, build_examples
from bigtune.recipe import DataConfig, RecipeError, load_recipe
from conftest import read_jsonl, tiny_overrides


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def alpaca(word: str, n: int) -> list[dict]:
    return [{"instruction": f"Say {word} {i}.", "input": "", "output": f"{word} number {i}."} for i in range(n)]


@pytest.fixture
def two_sources(tmp_path):
    """12 alpaca records about apples, 12 plain-text records about pears (two formats)."""
    a = write_jsonl(tmp_path / "apples.jsonl", alpaca("apple", 12))
    b = write_jsonl(tmp_path / "pears.jsonl", [{"body": f"pear text {i} is here."} for i in range(12)])
    return a, b


def mix_config(a: str, b: str, **kw) -> DataConfig:
    sources = [{"source": a, "weight": 3}, {"source": b, "weight": 1, "format": "jsonl-text", "text_field": "body"}]
    return DataConfig(sources=sources, **kw)


def key(example) -> tuple:
    return tuple(example.input_ids)


def which_source(examples, tok, a: str, b: str) -> Counter:
    """How many of ``examples`` each source holds (by their tokens: each source built alone)."""
    alone_a = {key(e) for e in build_examples(DataConfig(source=a), tok, 0)[0]}
    alone_b = {key(e) for e in build_examples(DataConfig(source=b, text_field="body"), tok, 0)[0]}
    assert not alone_a & alone_b
    return Counter("a" if key(e) in alone_a else "b" if key(e) in alone_b else "?" for e in examples)


def test_weights_3_to_1_give_three_times_the_samples(two_sources, tok):
    a, b = two_sources
    examples, report = build_examples(mix_config(a, b), tok, seed=0)
    assert which_source(examples, tok, a, b) == Counter(a=36, b=12)
    # weight 3 repeats each of the 12 apple samples exactly three times; each pear sample is there once
    assert Counter(Counter(key(e) for e in examples).values()) == Counter({3: 12, 1: 12})
    assert report.format == "alpaca/jsonl-text"
    assert [s["mixed_samples"] for s in report.sources] == [36, 12]
    assert "75% of the mixture" in "\n".join(report.lines())


def test_held_out_split_has_every_source_and_never_trains(two_sources, tok):
    a, b = two_sources
    examples, report = build_examples(mix_config(a, b, val_fraction=0.25), tok, seed=0)
    val = report.val_examples
    assert which_source(val, tok, a, b) == Counter(a=3, b=3)  # 25% of each, not weighted
    assert report.validation == 6
    assert not {key(e) for e in val} & {key(e) for e in examples}
    assert which_source(examples, tok, a, b) == Counter(a=27, b=9)  # 9 left of each, then 3:1


def test_mixture_is_deterministic_per_seed(two_sources, tok):
    a, b = two_sources
    cfg = mix_config(a, b, val_fraction=0.25)
    cfg.sources[0]["weight"] = 1.5
    first, rep1 = build_examples(cfg, tok, seed=3)
    again, rep2 = build_examples(cfg, tok, seed=3)
    _, rep_other = build_examples(cfg, tok, seed=4)
    assert [key(e) for e in first] == [key(e) for e in again]
    assert [key(e) for e in rep1.val_examples] == [key(e) for e in rep2.val_examples]
    assert [key(e) for e in rep1.val_examples] != [key(e) for e in rep_other.val_examples]


def test_fractional_weight_keeps_a_seeded_share(two_sources, tok):
    a, b = two_sources
    cfg = mix_config(a, b)
    cfg.sources[0]["weight"] = 2.5
    cfg.sources[1]["weight"] = 0.5
    examples, _ = build_examples(cfg, tok, seed=0)
    assert which_source(examples, tok, a, b) == Counter(a=30, b=6)
    pears = [key(e) for e in examples if which_source([e], tok, a, b)["b"]]
    assert len(set(pears)) == 6  # half of them, none twice


def test_num_train_samples_picks_from_the_mixture(two_sources, tok):
    a, b = two_sources
    examples, report = build_examples(mix_config(a, b, num_train_samples=20), tok, seed=0)
    assert len(examples) == report.used == 20


def test_a_bad_record_file_names_the_source_index_file_and_line(two_sources, tmp_path, tok):
    a, _ = two_sources
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(alpaca("fig", 1)[0]) + "\n{not json\n")
    with pytest.raises(DataError) as e:
        build_examples(DataConfig(sources=[{"source": a}, {"source": str(bad)}]), tok, seed=0)
    msg = str(e.value)
    assert msg.startswith(f"data.sources[1] ({bad}): ")
    assert f"{bad} line 2" in msg


def test_missing_source_path_is_a_recipe_error_naming_the_index(two_sources, tmp_path):
    a, _ = two_sources
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(RecipeError) as e:
        load_recipe({"data": {"sources": [{"source": a, "weight": 3}, {"source": str(missing)}]}})
    assert e.value.problems == [
        f"data.sources[1].source: {missing} does not exist; give a file or save_to_disk folder, `hf:<id>` or `demo`"
    ]


def test_missing_source_path_in_the_data_layer_names_the_index(two_sources, tmp_path, tok):
    a, _ = two_sources
    with pytest.raises(DataError, match=r"^data\.sources\[1\] \(.*nowhere\.jsonl\): .*nowhere\.jsonl does not exist"):
        build_examples(DataConfig(sources=[{"source": a}, {"source": str(tmp_path / "nowhere.jsonl")}]), tok, 0)


@pytest.mark.parametrize(
    "entry, problem",
    [
        ({"source": "demo", "weight": 0}, "data.sources[0].weight: 0 must be a number above 0"),
        ({"source": "demo", "weigth": 2}, "data.sources[0].weigth: unknown key; did you mean weight?"),
        ({"weight": 2}, "data.sources[0].source: missing"),
        ({"source": "demo", "format": "csv"}, "data.sources[0].format: 'csv' is not allowed"),
        ("demo", "data.sources[0]: got 'demo'; expected a mapping"),
    ],
)
def test_bad_entries_are_recipe_errors_naming_the_index(entry, problem):
    with pytest.raises(RecipeError) as e:
        load_recipe({"data": {"sources": [entry]}})
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(problem), e.value.problems


def test_sources_beside_source_or_for_another_family_are_refused(two_sources):
    a, b = two_sources
    with pytest.raises(RecipeError, match="data.sources with data.source"):
        load_recipe({"data": {"source": b, "sources": [{"source": a}]}})
    with pytest.raises(RecipeError, match="mixing sources is for causal-lm models"):
        load_recipe(
            {"model": {"name": "tiny-bert", "family": "sequence-classification"}, "data": {"sources": [{"source": a}]}}
        )


def test_val_source_replaces_the_held_out_split(two_sources, tmp_path, tok):
    a, b = two_sources
    examples, report = build_examples(mix_config(a, b, val_fraction=0.25, val_source=a), tok, seed=0)
    assert report.val_examples == [] and len(examples) == 48  # nothing held out of the sources


def test_tiny_run_trains_on_a_3_to_1_mixture_and_plans_it(two_sources, tmp_path):
    """A whole run on the mixture: trains, evaluates on both sources, and the planner counts the same steps."""
    from bigtune.plan.search.runlength import data_size
    from bigtune.run.training import train

    a, b = two_sources
    run = tmp_path / "run"
    over = tiny_overrides(
        run,
        **{
            "data.source": "demo",
            "data.sources": mix_config(a, b).sources,
            "data.val_fraction": 0.25,
            "train.max_steps": 3,
        },
    )
    train({}, over)
    summary = json.loads((run / "summary.json").read_text())
    data = summary["data"]
    assert [(s["mixed_samples"], s["validation"]) for s in data["sources"]] == [(27, 3), (9, 3)]
    assert data["used"] == 36 and data["validation"] == 6
    steps = [m for m in read_jsonl(run / "metrics.jsonl") if "loss" in m and "step" in m]
    assert steps and steps[-1]["step"] == 3
    # The plan reads the data as train does: 36 training samples, 6 for validation.
    size = data_size(load_recipe({}, over))
    assert (size.train, size.validation) == (36, 6)
