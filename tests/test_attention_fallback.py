"""Architectures without SDPA attention (Gemma-2, BLOOM) run eager attention under the default
``model.attn_implementation: sdpa``, and the run and the plan say so, instead of transformers' ValueError."""

from __future__ import annotations

import json

import pytest

from bigtune.core.presets import tiny_tokenizer
from bigtune.recipe import load_recipe
from conftest import run_cli


def _tiny_folder(tmp_path, kind: str):
    from transformers import BloomConfig, Gemma2Config

    tok = tiny_tokenizer()
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    if kind == "gemma2":  # soft-capping and alternating sliding-window layers, as the real ones
        cfg = Gemma2Config(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=16,
            **ids,
        )
    else:
        cfg = BloomConfig(vocab_size=len(tok), hidden_size=32, n_layer=2, n_head=4, **ids)
    folder = tmp_path / kind
    cfg.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["gemma2", "bloom"])
def test_a_model_without_sdpa_trains_with_eager_attention_and_says_so(tmp_path, kind):
    folder = _tiny_folder(tmp_path, kind)
    run = tmp_path / "run"
    over = [
        f"model.name={folder}",
        "model.init=random",
        "train.max_steps=10",
        "train.log_every_steps=1",
        f"output_dir={run}",
    ]
    res = run_cli("train", *[a for o in over for a in ("--set", o)], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "eager attention is used" in res.stdout and "scaled_dot_product_attention" not in res.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["final_loss"] < summary["first_loss"]
    # the plan printed before step 0 ran the same eager step: it matches the measured CPU peak
    assert any("eager attention is used" in n for n in summary["plan"]["notes"])
    assert abs(summary["plan"]["peak_error_pct"]) < 2.0, summary["plan"]["peak_error_pct"]


@pytest.mark.parametrize("name", ["google/gemma-2-2b", "bigscience/bloom-560m"])
def test_plan_of_a_model_without_sdpa_with_default_settings(name, tmp_path):
    res = run_cli("plan", "--set", f"model.name={name}", "--gpu", "a100-80gb", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "FITS" in res.stdout and "eager attention is used" in res.stdout


def test_an_explicit_eager_recipe_gets_no_note():
    from bigtune.models.build import attention_for
    from bigtune.models.configs import resolve_config

    r = load_recipe({}, {"model.name": "google/gemma-2-2b", "model.attn_implementation": "eager"})
    assert attention_for(r.model, resolve_config(r)) == ("eager", None)
    r = load_recipe({}, {"model.name": "google/gemma-2-2b"})
    attn, note = attention_for(r.model, resolve_config(r))
    assert attn == "eager" and "Gemma2ForCausalLM" in note
    r = load_recipe({}, {"model.name": "openlm-research/open_llama_7b"})
    assert attention_for(r.model, resolve_config(r)) == ("sdpa", None)
