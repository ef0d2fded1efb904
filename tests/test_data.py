"""The data pipeline: reading every source kind, masking, skipping bad records, selection, batching, sampling.

Everything runs offline on the bundled tiny tokenizer and files written under tmp_path.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from bigtune.core.presets import tiny_tokenizer
from bigtune.core.stepmath import IGNORE_INDEX
from bigtune.data.text import Collator, DataError, EpochSampler, Example, build_examples, format_prompt
from bigtune.recipe import DataConfig

GOOD = {"instruction": "Name a fruit.", "input": "red", "output": "An apple."}
GOOD_NO_INPUT = {"instruction": "Say hello.", "input": "", "output": "Hello there."}


# -- helpers ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """Keep datasets' csv/parquet builder cache inside tmp_path instead of ~/.cache."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    return tmp_path / "hf_cache"


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def build(path: Path, tok, seed: int = 0, **cfg):
    return build_examples(DataConfig(source=str(path), **cfg), tok, seed=seed)


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def alpaca_ids(tok, rec: dict) -> tuple[list[int], list[int]]:
    """(bos + prompt tokens, response tokens + eos) exactly as the training format should build them."""
    prompt = [tok.bos_token_id] + ids(tok, format_prompt(rec["instruction"], rec.get("input") or ""))
    return prompt, ids(tok, rec["output"]) + [tok.eos_token_id]


def numbered_records(n: int) -> list[dict]:
    return [{"instruction": f"Count to {i}.", "input": "", "output": f"Answer number {i}."} for i in range(n)]


# -- alpaca: prompt masking -------------------------------------------------------------------------


def test_alpaca_masks_bos_and_prompt_and_learns_response_and_eos(tmp_path, tok):
    examples, report = build(write_jsonl(tmp_path / "d.jsonl", [GOOD]), tok)
    prompt, answer = alpaca_ids(tok, GOOD)
    (ex,) = examples
    assert report.format == "alpaca"
    assert ex.input_ids == prompt + answer
    assert ex.labels == [IGNORE_INDEX] * len(prompt) + answer
    assert ex.input_ids[-1] == tok.eos_token_id


def test_alpaca_prompt_tokens_follow_format_prompt_with_and_without_input(tmp_path, tok):
    examples, _ = build(write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD_NO_INPUT]), tok)
    with_input, no_input = examples
    p1 = ids(tok, format_prompt(GOOD["instruction"], GOOD["input"]))
    p2 = ids(tok, format_prompt(GOOD_NO_INPUT["instruction"]))
    assert "### Input:" in format_prompt("x", "y") and "### Input:" not in format_prompt("x")
    assert with_input.input_ids[1 : 1 + len(p1)] == p1
    assert no_input.input_ids[1 : 1 + len(p2)] == p2
    assert with_input.input_ids[0] == no_input.input_ids[0] == tok.bos_token_id


def test_alpaca_without_mask_prompt_labels_equal_input_ids(tmp_path, tok):
    examples, _ = build(write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD_NO_INPUT]), tok, mask_prompt=False)
    for ex, rec in zip(examples, [GOOD, GOOD_NO_INPUT]):
        prompt, answer = alpaca_ids(tok, rec)
        assert ex.input_ids == prompt + answer
        assert ex.labels == ex.input_ids
        assert IGNORE_INDEX not in ex.labels


def test_demo_source_is_alpaca(tok):
    examples, report = build_examples(DataConfig(source="demo"), tok, seed=0)
    assert report.format == "alpaca"
    assert report.used == len(examples) == report.records > 0


# -- bad records ------------------------------------------------------------------------------------

LONG_PROMPT = {"instruction": "word " * 200, "input": "", "output": "ok"}
BAD_LINES = [
    json.dumps(GOOD),  # 0 good
    json.dumps({"instruction": "No answer."}),  # 1 missing output
    json.dumps({"instruction": 5, "output": "five"}),  # 2 instruction not text
    json.dumps({"instruction": "Blank.", "output": "   "}),  # 3 empty output
    json.dumps([GOOD["instruction"], GOOD["output"]]),  # 4 array, not object
    json.dumps(LONG_PROMPT),  # 5 prompt fills max_seq_length
    json.dumps(GOOD_NO_INPUT),  # 6 good
]


@pytest.fixture
def mixed_file(tmp_path) -> Path:
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(BAD_LINES) + "\n", encoding="utf-8")
    return path


def test_bad_records_are_skipped_with_index_and_reason(mixed_file, tok):
    examples, report = build(mixed_file, tok, max_seq_length=64)
    assert [i for i, _ in report.skipped] == [1, 2, 3, 4, 5]
    reasons = dict(report.skipped)
    assert reasons[1] == "missing 'output'"
    assert reasons[2] == "'instruction' is int, not text"
    assert reasons[3] == "empty 'output'"
    assert reasons[4] == "not an object (list)"
    assert "longer than data.max_seq_length=64" in reasons[5] and "no response tokens left" in reasons[5]


def test_bad_records_counts_and_report_text(mixed_file, tok):
    examples, report = build(mixed_file, tok, max_seq_length=64)
    assert report.records == 7
    assert report.used == len(examples) == 2
    assert [e.input_ids for e in examples] == [sum(alpaca_ids(tok, GOOD), []), sum(alpaca_ids(tok, GOOD_NO_INPUT), [])]
    summary = report.summary()
    assert summary["skipped"] == 5 and summary["used"] == 2
    assert {"index": 4, "reason": "not an object (list)"} in summary["skipped_examples"]
    assert "  skipped record 1: missing 'output'" in report.lines()


def test_skip_bad_records_false_raises_on_first_bad_record(mixed_file, tok):
    with pytest.raises(DataError) as err:
        build(mixed_file, tok, max_seq_length=64, skip_bad_records=False)
    msg = str(err.value)
    assert "record 1:" in msg and "missing 'output'" in msg
    assert str(mixed_file) in msg


def test_skip_bad_records_false_accepts_a_clean_file(tmp_path, tok):
    examples, report = build(write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD_NO_INPUT]), tok, skip_bad_records=False)
    assert len(examples) == report.used == 2 and report.skipped == []


# -- unparseable files ------------------------------------------------------------------------------


def test_corrupt_jsonl_line_names_file_and_line_counting_blank_lines(tmp_path, tok):
    path = tmp_path / "broken.jsonl"
    path.write_text(
        json.dumps(GOOD) + "\n\n   \n" + '{"instruction": "x", "output": \n' + json.dumps(GOOD) + "\n", encoding="utf-8"
    )
    with pytest.raises(DataError) as err:
        build(path, tok)
    msg = str(err.value)
    assert f"{path} line 4 column " in msg  # the file's line, the column within it
    assert "not valid JSON" in msg


def test_corrupt_jsonl_is_an_error_even_when_skipping_bad_records(tmp_path, tok):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(GOOD) + "\nnot json at all\n", encoding="utf-8")
    with pytest.raises(DataError, match="line 2"):
        build(path, tok, skip_bad_records=True)


def test_corrupt_json_file_names_file_and_line(tmp_path, tok):
    path = tmp_path / "broken.json"
    path.write_text("[\n" + json.dumps(GOOD) + ",\n{oops}\n]\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        build(path, tok)
    assert f"{path} line 3 column 2:" in str(err.value)  # where the parser stopped: `{oops}`'s o


# -- nothing usable ---------------------------------------------------------------------------------


def test_all_bad_file_raises_no_usable_samples_with_first_problem(tmp_path, tok):
    path = write_jsonl(
        tmp_path / "bad.jsonl", [{"instruction": "a", "output": ""}, {"instruction": "b", "output": " "}]
    )
    with pytest.raises(DataError) as err:
        build(path, tok)
    msg = str(err.value)
    assert "no usable samples" in msg
    assert "2 skipped" in msg and "first problem: record 0: empty 'output'" in msg


@pytest.mark.parametrize("content", ["", "\n\n  \n"], ids=["empty", "blank-lines"])
def test_empty_jsonl_raises_no_usable_samples(tmp_path, tok, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match="no usable samples"):
        build(path, tok)


def test_empty_txt_raises_no_usable_samples(tmp_path, tok):
    path = tmp_path / "empty.txt"
    path.write_text("", encoding="utf-8")
    with pytest.raises(DataError, match="no usable samples"):
        build(path, tok)


# -- plain text -------------------------------------------------------------------------------------

TEXT = " ".join(f"token{i} the quick brown fox" for i in range(40))


def test_txt_is_cut_into_consecutive_max_seq_length_blocks(tmp_path, tok):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    examples, report = build(path, tok, max_seq_length=16)
    all_ids = ids(tok, TEXT)
    assert report.format == "text"
    assert report.records == report.used == len(examples) > 2
    assert all(len(e.input_ids) == 16 for e in examples[:-1])
    assert 2 <= len(examples[-1].input_ids) <= 16
    joined = [t for e in examples for t in e.input_ids]
    assert joined == all_ids[: len(joined)] and len(all_ids) - len(joined) <= 1


def test_txt_labels_equal_input_ids(tmp_path, tok):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    examples, _ = build(path, tok, max_seq_length=16)
    assert all(e.labels == e.input_ids for e in examples)


def test_txt_trailing_single_token_block_is_dropped(tmp_path, tok):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    n = len(ids(tok, TEXT))
    examples, _ = build(path, tok, max_seq_length=n - 1)
    assert [len(e.input_ids) for e in examples] == [n - 1]


# -- jsonl with a text column -----------------------------------------------------------------------


def test_jsonl_text_field_is_auto_detected(tmp_path, tok):
    texts = ["hello world", "the quick brown fox jumps"]
    examples, report = build(write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts]), tok)
    assert report.format == "jsonl-text"
    for ex, t in zip(examples, texts):
        assert ex.input_ids == [tok.bos_token_id] + ids(tok, t) + [tok.eos_token_id]
        assert ex.labels == ex.input_ids


def test_custom_text_field_reads_that_column(tmp_path, tok):
    path = write_jsonl(tmp_path / "t.jsonl", [{"id": 1, "body": "hello world"}, {"id": 2, "body": "good day"}])
    examples, report = build(path, tok, text_field="body")
    assert report.format == "jsonl-text" and report.used == 2
    assert examples[1].input_ids == [tok.bos_token_id] + ids(tok, "good day") + [tok.eos_token_id]


def test_text_records_missing_or_empty_text_are_skipped(tmp_path, tok):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello world"}, {"other": "x"}, {"text": "  "}])
    _, report = build(path, tok)
    assert report.skipped == [(1, "missing text field 'text'"), (2, "empty text")]
    assert report.used == 1


# -- datasets folders, csv, parquet, json -----------------------------------------------------------


@pytest.fixture
def dataset_dict_dir(tmp_path, hf_cache) -> Path:
    import datasets

    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(numbered_records(3)),
            "test": datasets.Dataset.from_list([GOOD, GOOD_NO_INPUT]),
        }
    )
    path = tmp_path / "saved"
    dd.save_to_disk(str(path))
    return path


@pytest.mark.parametrize("split,expected", [("train", numbered_records(3)), ("test", [GOOD, GOOD_NO_INPUT])])
def test_save_to_disk_folder_is_read_by_split(dataset_dict_dir, tok, split, expected):
    examples, report = build(dataset_dict_dir, tok, split=split)
    assert report.format == "alpaca" and report.used == len(expected)
    assert [e.input_ids for e in examples] == [sum(alpaca_ids(tok, r), []) for r in expected]


def test_save_to_disk_missing_split_lists_available_splits(dataset_dict_dir, tok):
    with pytest.raises(DataError) as err:
        build(dataset_dict_dir, tok, split="validation")
    msg = str(err.value)
    assert "['test', 'train']" in msg and "'validation'" in msg


def test_csv_with_alpaca_columns(tmp_path, hf_cache, tok):
    path = tmp_path / "d.csv"
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=["instruction", "input", "output"])
        writer.writeheader()
        writer.writerows([GOOD, GOOD_NO_INPUT])
    examples, report = build(path, tok)
    assert report.format == "alpaca" and report.used == 2
    assert [e.input_ids for e in examples] == [sum(alpaca_ids(tok, GOOD), []), sum(alpaca_ids(tok, GOOD_NO_INPUT), [])]


def test_parquet_with_alpaca_columns(tmp_path, hf_cache, tok):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    try:
        pq.write_table(pa.Table.from_pylist([GOOD, GOOD_NO_INPUT]), str(path))
    except Exception as e:  # pragma: no cover - depends on the pyarrow build
        pytest.skip(f"pyarrow cannot write parquet here: {e}")
    examples, report = build(path, tok)
    assert report.format == "alpaca" and report.used == 2
    assert examples[0].input_ids == sum(alpaca_ids(tok, GOOD), [])


def test_json_file_with_records_under_split_key(tmp_path, tok):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"train": [GOOD], "test": [GOOD_NO_INPUT, GOOD]}), encoding="utf-8")
    _, report = build(path, tok, split="test")
    assert report.used == 2


# -- num_train_samples ------------------------------------------------------------------------------


@pytest.fixture
def twenty(tmp_path) -> Path:
    return write_jsonl(tmp_path / "twenty.jsonl", numbered_records(20))


def kept_indices(examples, tok) -> list[int]:
    by_ids = {tuple(sum(alpaca_ids(tok, r), [])): i for i, r in enumerate(numbered_records(20))}
    return [by_ids[tuple(e.input_ids)] for e in examples]


def test_num_train_samples_keeps_exactly_that_many(twenty, tok):
    examples, report = build(twenty, tok, num_train_samples=5)
    assert len(examples) == report.used == 5
    assert report.records == 20
    kept = kept_indices(examples, tok)
    assert len(set(kept)) == 5 and kept == sorted(kept)


def test_num_train_samples_is_deterministic_per_seed(twenty, tok):
    a, _ = build(twenty, tok, seed=0, num_train_samples=5)
    b, _ = build(twenty, tok, seed=0, num_train_samples=5)
    c, _ = build(twenty, tok, seed=1, num_train_samples=5)
    assert kept_indices(a, tok) == kept_indices(b, tok)
    assert kept_indices(a, tok) != kept_indices(c, tok)


def test_num_train_samples_larger_than_data_keeps_all(twenty, tok):
    examples, report = build(twenty, tok, num_train_samples=50)
    assert kept_indices(examples, tok) == list(range(20)) and report.used == 20


# -- truncation -------------------------------------------------------------------------------------


def test_long_alpaca_record_is_truncated_and_counted(tmp_path, tok):
    long = {"instruction": "Tell a story.", "input": "", "output": "once upon a time " * 50}
    examples, report = build(write_jsonl(tmp_path / "d.jsonl", [GOOD_NO_INPUT, long]), tok, max_seq_length=48)
    short_ex, long_ex = examples
    prompt, answer = alpaca_ids(tok, long)
    assert report.truncated == 1 and report.used == 2 and report.skipped == []
    assert len(long_ex.input_ids) == len(long_ex.labels) == 48
    assert long_ex.input_ids == (prompt + answer)[:48]
    assert long_ex.labels == ([IGNORE_INDEX] * len(prompt) + answer)[:48]
    assert short_ex.input_ids == sum(alpaca_ids(tok, GOOD_NO_INPUT), [])


def test_long_text_record_is_truncated_and_counted(tmp_path, tok):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "hi"}, {"text": TEXT}])
    examples, report = build(path, tok, max_seq_length=32)
    assert report.truncated == 1
    assert len(examples[1].input_ids) == 32
    assert examples[1].input_ids == ([tok.bos_token_id] + ids(tok, TEXT))[:32]


# -- collator ---------------------------------------------------------------------------------------


def two_examples() -> list[Example]:
    return [Example([5, 6, 7], [IGNORE_INDEX, 6, 7]), Example([1, 2, 3, 4, 5], [1, 2, 3, 4, 5])]


def test_collator_right_pads_with_pad_id():
    batch = Collator(pad_id=9)(two_examples())
    assert batch["input_ids"].dtype == torch.long
    assert batch["input_ids"].tolist() == [[5, 6, 7, 9, 9], [1, 2, 3, 4, 5]]


def test_collator_padding_has_ignored_labels_and_zero_mask():
    batch = Collator(pad_id=9)(two_examples())
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 6, 7, IGNORE_INDEX, IGNORE_INDEX], [1, 2, 3, 4, 5]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]


@pytest.mark.parametrize("multiple,width", [(1, 5), (4, 8), (5, 5), (8, 8)])
def test_collator_pad_to_multiple_of(multiple, width):
    batch = Collator(pad_id=0, pad_to_multiple_of=multiple)(two_examples())
    for key in ("input_ids", "attention_mask", "labels"):
        assert tuple(batch[key].shape) == (2, width)
    assert batch["attention_mask"].sum(dim=1).tolist() == [3, 5]
    assert (batch["labels"][:, 5:] == IGNORE_INDEX).all()


# -- sampler ----------------------------------------------------------------------------------------


def test_epoch_sampler_is_a_deterministic_permutation():
    a, b = EpochSampler(50, seed=3), EpochSampler(50, seed=3)
    assert a.order() == b.order() == list(a)
    assert sorted(a.order()) == list(range(50))
    assert a.order() != list(range(50))
    assert len(a) == 50


def test_epoch_sampler_differs_across_epochs_and_seeds():
    s = EpochSampler(50, seed=3)
    epoch0 = s.order()
    s.set_epoch(1)
    epoch1 = s.order()
    assert epoch1 != epoch0 and sorted(epoch1) == list(range(50))
    other = EpochSampler(50, seed=3)
    other.set_epoch(1)
    assert other.order() == epoch1
    assert EpochSampler(50, seed=4).order() != epoch0


def test_epoch_sampler_resumes_mid_epoch():
    s = EpochSampler(50, seed=3)
    s.set_epoch(2, 17)
    assert list(s) == s.order()[17:]
    assert len(s) == 33
    s.set_epoch(3)
    assert list(s) == s.order() and len(s) == 50


def test_epoch_sampler_without_shuffle_is_in_order():
    s = EpochSampler(6, seed=3, shuffle=False)
    s.set_epoch(5, 2)
    assert list(s) == [2, 3, 4, 5]


# -- source and format errors -----------------------------------------------------------------------


def test_unknown_extension_is_named(tmp_path, tok):
    path = tmp_path / "data.xml"
    path.write_text("<records/>", encoding="utf-8")
    with pytest.raises(DataError) as err:
        build(path, tok)
    assert "'.xml'" in str(err.value) and str(path) in str(err.value)


def test_missing_source_file_is_named(tmp_path, tok):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match="does not exist"):
        build(path, tok)


def test_format_detection_failure_names_the_keys_found(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError) as err:
        build(path, tok)
    msg = str(err.value)
    assert "cannot tell the format" in msg and "['answer', 'question']" in msg


def test_explicit_format_overrides_detection(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b", "text": "hello world"}])
    examples, report = build(path, tok, format="jsonl-text")
    assert report.format == "jsonl-text"
    assert examples[0].input_ids == [tok.bos_token_id] + ids(tok, "hello world") + [tok.eos_token_id]
