"""bench/published.py's table cannot rot: every row's recipe loads and validates, every GPU name resolves
(no planning; a few seconds)."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from bigtune.core.gpus import find_gpu
from bigtune.models.configs import bundled_config_path
from conftest import ROOT

_spec = importlib.util.spec_from_file_location("published", ROOT / "bench" / "published.py")
published = importlib.util.module_from_spec(_spec)
sys.modules["published"] = published  # dataclasses look their module up by name
_spec.loader.exec_module(published)


def test_row_ids_are_unique():
    ids = [r.id for r in published.ROWS]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("row", published.ROWS, ids=lambda r: r.id)
def test_row_recipe_validates_and_gpu_resolves(row):
    r = published.row_recipe(row)  # load_recipe + check_combinations (less host-only rules)
    assert bundled_config_path(r.model.name) is not None, f"{row.id}: {r.model.name} has no bundled config"
    find_gpu(row.gpu)
    assert row.metric in ("peak_allocated", "after_forward_allocated", "reserved", "device_used", "fit")
    if row.metric == "fit":
        assert row.expect in ("fit", "oom") and row.value is None
    else:
        assert row.value_gib() > 0
    assert (row.gpus > 1) == (r.world_size > 1) and r.world_size == row.gpus
    if row.gpus > 1 or row.strategy.startswith("deepspeed"):
        assert r.strategy == row.strategy  # the recipe says what the planner's Target is told


def test_bundled_bert_large_config_gives_the_published_parameter_count():
    """bert-large-uncased.json (added for the HF rows) against BertModel's published 335,141,888 parameters
    (pooler included); the sequence classifier adds its 1024 × 2 + 2 head."""
    from bigtune.models.configs import resolve_config
    from bigtune.plan.planner import count_parameters

    row = next(r for r in published.ROWS if r.id == "H1")
    cfg = resolve_config(published.row_recipe(row))
    assert count_parameters(cfg, "sequence-classification") == 335_141_888 + 1024 * 2 + 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_legacy_softmax_keeps_an_fp32_input_and_keeps_the_gradient(monkeypatch, dtype):
    """Row.legacy_softmax's emulation: softmax saves its input as well as its output, as PyTorch < 1.11 did
    (an fp32 input, also for a 16-bit one: the old BERT's fp32 mask made it so), and its gradient is
    unchanged."""
    import torch

    # restored after the test: the emulation replaces F.softmax for the whole (planning) process
    monkeypatch.setattr(torch.nn.functional, "softmax", torch.nn.functional.softmax)
    x = torch.randn(2, 3, 8, dtype=getattr(torch, dtype), requires_grad=True)
    g = torch.randn(2, 3, 8)
    expected = torch.autograd.grad(torch.softmax(x.float(), -1), x, g)[0]
    published._keep_softmax_inputs()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = torch.nn.functional.softmax(x, dim=-1)
    assert y.dtype == torch.float32
    assert len(saved) == 2 and all(t.dtype == torch.float32 and t.shape == x.shape for t in saved)
    assert torch.equal(saved[0], x.float())  # the input, kept beside the output
    (grad,) = torch.autograd.grad(y, x, g)
    assert torch.allclose(grad.float(), expected.float(), atol=1e-2 if dtype == "bfloat16" else 1e-6)


def test_published_rates_faster_than_the_dense_peak_are_kept_out_of_the_time_statistic():
    """A published rate is checked against the plan's dense-peak floor (time.step_time's note, parsed here):
    faster than the card can multiply the step's FLOPs, it cannot be the stated setup."""
    from bigtune.core.gpus import find_gpu as gpu
    from bigtune.plan.device.roofline import step_seconds
    from bigtune.plan.layout.time import peak_floor_note

    ops = {("gemm", "forward", "bf16", (1, 4096, 4096, 4096)): [1, 2.0 * 4096**3, 1.0]}
    t = step_seconds(ops, gpu("rtx-4090"), "bf16")
    assert published.peak_floor_s(["time: roofline ...", peak_floor_note(t)]) == pytest.approx(t["peak_s"], rel=1e-3)
    assert published.peak_floor_s(["no time"]) is None
    rows = [
        {
            "id": "slow",
            "metric": "reserved",
            "impl": "",
            "error_pct": 1.0,
            "time_error_pct": 20.0,
            "implied_peak_pct": 40,
        },
        {
            "id": "fast",
            "metric": "reserved",
            "impl": "",
            "error_pct": 2.0,
            "time_error_pct": 90.0,
            "implied_peak_pct": 130,
        },
    ]
    s = published.statistics_of(rows)
    assert s["step_time"]["n"] == 1 and s["step_time"]["worst_id"] == "slow"
    assert s["step_time_beyond_peak"] == ["fast"] and s["reserved"]["n"] == 2


def test_litgpt_gelu_emulation_is_the_same_function_fused(monkeypatch):
    """litgpt-gelu swaps transformers' written-out gelu_new for the fused tanh GELU litgpt calls: the same
    values (it changes what the backward keeps, not the result)."""
    import torch
    from transformers import activations

    monkeypatch.setattr(activations.NewGELUActivation, "forward", activations.NewGELUActivation.forward)
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    written_out = activations.NewGELUActivation()(x)
    published._litgpt_gelu()
    fused = activations.NewGELUActivation()(x)
    assert torch.allclose(fused, written_out, atol=1e-12)


def test_keep_gradients_emulation_zeroes_in_place(monkeypatch):
    """keep_gradients: zero_grad as before PyTorch 2.0 (set_to_none=False), so the gradient tensors stay
    allocated, zeroed, whatever the caller asks."""
    import torch

    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", torch.optim.Optimizer.zero_grad)
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    (w * 2).sum().backward()
    grad = w.grad
    published._keep_gradients()
    opt.zero_grad(set_to_none=True)
    assert w.grad is grad and torch.equal(grad, torch.zeros(3))


@pytest.mark.parametrize(
    "expect, at_cap, at_shortest, outcome",
    [
        ("fit", True, None, True),  # the row's lengths are the run's: the plan's verdict is the check
        ("fit", False, None, False),
        ("oom", False, None, True),
        ("fit", True, True, True),  # fits at the cap: fits every shorter run
        ("fit", False, False, False),  # OOM even at the shortest batch: contradicts a published fit
        ("oom", True, True, False),  # fits at the cap: contradicts a published OOM
        ("oom", False, False, True),
        ("fit", False, True, None),  # the ends differ: the unpublished lengths decide
        ("oom", False, True, None),
    ],
)
def test_fit_outcome_settles_only_what_the_stated_lengths_settle(expect, at_cap, at_shortest, outcome):
    assert published.fit_outcome(expect, at_cap, at_shortest) is outcome


def test_only_the_lab_blip_fit_rows_have_a_shortest_batch():
    rows = {r.id: r for r in published.ROWS}
    assert rows["B8"].shortest_over() == {"data.max_seq_length": 2} and rows["B8"].lab_blip_inputs()
    assert rows["LF1"].shortest_over() is None and not rows["LF1"].lab_blip_inputs()
    assert all(r.shortest_over() is None for r in published.ROWS if r.metric != "fit")


@pytest.mark.parametrize("preset", ["tiny-blip2-opt", "tiny-blip2-t5"])
def test_lab_blip_inputs_feed_the_language_model_the_caption_alone(monkeypatch, preset):
    """The emulated batch holds the captions' tokens and no <image> placeholder, labels = input_ids, as the
    lab's script builds it; a real (tiny) BLIP-2 fed such a batch runs its language model over the caption
    alone (the Q-Former's outputs have no placeholder to go to), where bigtune's own batch adds 32 positions."""
    import torch
    from transformers import Blip2ForConditionalGeneration

    from bigtune.core.presets import preset_config, preset_processor
    from bigtune.plan.step import simulate
    from bigtune.recipe import load_recipe

    monkeypatch.setattr(simulate, "_synthetic_batch", simulate._synthetic_batch)
    cfg = preset_config(preset, preset_processor(preset))
    r = load_recipe({}, {"model.name": preset, "model.family": "image-to-text", "data.max_seq_length": 12})
    ours = simulate._synthetic_batch(r, cfg, "image-to-text", 2, False)
    published._lab_blip_inputs()
    lab = simulate._synthetic_batch(r, cfg, "image-to-text", 2, False)
    ids = lab["input_ids"]
    assert ids.shape == (2, 12) and not (ids == cfg.image_token_index).any()
    assert torch.equal(lab["labels"], ids) and bool(lab["attention_mask"].all())
    encoder_decoder = "decoder_input_ids" in lab
    if encoder_decoder:  # T5 reads the labels shifted right
        assert torch.equal(lab["decoder_input_ids"][:, 1:], ids[:, :-1])
    torch.manual_seed(0)
    model = Blip2ForConditionalGeneration(cfg).eval()
    pixels = torch.zeros(2, 3, cfg.vision_config.image_size, cfg.vision_config.image_size)
    batches = [(ours, ours["input_ids"].shape[1] if not encoder_decoder else None), (lab, 12)]
    with torch.no_grad():
        for b, text_len in batches:
            kwargs = {k: b[k] for k in ("input_ids", "attention_mask", "labels", "decoder_input_ids") if k in b}
            out = model(pixel_values=pixels, **kwargs)
            if encoder_decoder:  # the encoder's length is what the language model reads beside the labels
                assert out.language_model_outputs.encoder_last_hidden_state.shape[1] == b["input_ids"].shape[1]
            else:
                assert out.logits.shape[1] == text_len
    assert ours["input_ids"].shape[1] == (cfg.num_query_tokens + (1 if encoder_decoder else 12))


def test_an_open_rows_longest_fitting_length_is_bisected(monkeypatch):
    """An open row (fits at the shortest batch, OOM at the 50-token cap) is planned between the two ends until
    the longest cap that still fits is found; each length is planned once."""
    asked = []

    def fake(row, timeout_s, shortest=False, length=None):
        asked.append(length)
        return {"plan": {"fits": length <= 37}, "seconds": 0.0}

    monkeypatch.setattr(published, "_plan_in_subprocess", fake)
    row = {r.id: r for r in published.ROWS}["B8"]
    plans: dict = {}
    assert published.longest_fitting(row, 1, plans, "k") == 37
    assert len(asked) == len(set(asked)) <= 6 and all(2 < n < 50 for n in asked)
    assert published.longest_fitting(row, 1, plans, "k") == 37 and len(asked) == len(set(asked))


def test_every_row_of_the_yaml_loads_into_a_row_with_a_unique_id():
    """bench/published_rows.yaml is the table: each mapping under rows: becomes one Row, in its order."""
    import yaml

    entries = yaml.safe_load(published.ROWS_FILE.read_text(encoding="utf-8"))["rows"]
    rows, texts = published.load_rows()
    assert [r.id for r in rows] == [e["id"] for e in entries] == [r.id for r in published.ROWS]
    assert all(isinstance(r, published.Row) for r in rows) and len({r.id for r in rows}) == len(rows)
    # a shared text cited by alias arrives joined: the runner tests rows against it
    assert published.LITGPT in texts["texts"]["LITGPT_LORA"] and texts["sources"]["LAB_BLIP"] == published.LAB_BLIP
    # aliases share objects in YAML; a row's overrides are its own (plan_row copies and extends them)
    assert all(a.over is not b.over for a, b in zip(rows, rows[1:]))


_GOOD = {"id": "X1", "source": "s", "setup": "x", "metric": "reserved", "value": 1.5, "unit": "GiB", "gpu": "a10g"}


def test_a_rows_lists_of_overrides_and_texts_merge_in_order(tmp_path):
    """over: a list of mappings applied in order (a later key replaces the value where the key stands);
    source/impl/note: a list of strings joined, so a row adds its words to a shared text."""
    import yaml

    base = {"precision": "bf16-true", "optim.name": "adamw"}
    row = {**_GOOD, "over": [base, {"model.name": "m", "precision": "32-true"}], "note": ["shared; ", "own"]}
    path = tmp_path / "rows.yaml"
    path.write_text(yaml.safe_dump({"rows": [row]}, sort_keys=False))
    (r,), _ = published.load_rows(path)
    assert list(r.over.items()) == [("precision", "32-true"), ("optim.name", "adamw"), ("model.name", "m")]
    assert r.note == "shared; own" and r.gpus == 1 and r.speed is None


@pytest.mark.parametrize(
    "field, bad, says",
    [
        ("value", "lots", "field 'value': expected a positive number"),
        ("gpus", 0, "field 'gpus'"),
        ("metric", "peak", "field 'metric': expected one of peak_allocated"),
        ("over", ["model.name"], "field 'over'"),
        ("speed", [10, "tokens/min"], "field 'speed'"),
        ("note", 3, "field 'note'"),
        ("legacy_softmax", "yes please", "field 'legacy_softmax'"),
        ("colour", "red", "unknown field 'colour'"),
        ("gpu", None, "field 'gpu'"),
    ],
)
def test_a_bad_field_is_refused_naming_the_row_and_the_field(tmp_path, field, bad, says):
    import yaml

    path = tmp_path / "rows.yaml"
    path.write_text(yaml.safe_dump({"rows": [_GOOD, {**_GOOD, "id": "X2", field: bad}]}, sort_keys=False))
    with pytest.raises(published.RowsFileError) as e:
        published.load_rows(path)
    assert "row X2" in str(e.value) and says in str(e.value)


@pytest.mark.parametrize(
    "second, says",
    [
        ({k: v for k, v in _GOOD.items() if k != "unit"}, "row X1: field 'unit' is missing"),
        (_GOOD, "row X1: field 'id' is used by rows #1 and #2"),
        ({**_GOOD, "id": "X3", "metric": "fit", "value": None, "unit": "-"}, "row X3: a fit row"),
        ({k: v for k, v in _GOOD.items() if k != "id"}, "row #2 (no id)"),
    ],
)
def test_a_missing_field_a_repeated_id_or_a_fit_row_without_outcome_is_refused(tmp_path, second, says):
    import yaml

    path = tmp_path / "rows.yaml"
    path.write_text(yaml.safe_dump({"rows": [_GOOD, second]}, sort_keys=False))
    with pytest.raises(published.RowsFileError, match=re.escape(says)):
        published.load_rows(path)


def test_a_bad_field_in_the_real_table_names_that_row(tmp_path):
    """The same check on the shipped file: one row's field spoilt, the error points at that row."""
    text = published.ROWS_FILE.read_text(encoding="utf-8")
    spoilt = text.replace("  - id: R6\n", "  - id: R6\n    gpus: two\n", 1)
    assert spoilt != text
    path = tmp_path / "published_rows.yaml"
    path.write_text(spoilt, encoding="utf-8")
    with pytest.raises(published.RowsFileError, match=r"row R6: field 'gpus': expected a whole number"):
        published.load_rows(path)
