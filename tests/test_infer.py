"""Inference verbs: loading what training wrote, batched generation, held-out loss and perplexity."""

from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bigtune.cli.generate import add_cli
from bigtune.core.presets import tiny_tokenizer
from bigtune.data.text import build_examples, format_prompt
from bigtune.models.build import build_model
from bigtune.recipe import DataConfig, ModelConfig
from bigtune.use.generate import evaluate, generate, generate_ids
from bigtune.use.loading import InferError, load_for_inference
from conftest import ROOT, tiny_overrides

PROMPTS = ["Hello there", "The quick brown fox jumps over", "a", "What is the best way to cook rice at home?", "x y z"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A Hugging Face folder holding the tiny Llama preset (random init, seed 0) and its tokenizer."""
    d = tmp_path_factory.mktemp("infer") / "tiny"
    tok = tiny_tokenizer()
    model = build_model(ModelConfig(name="tiny-llama"), tok, "32-true", seed=0)
    model.save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_for_inference(str(model_dir), device="cpu")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """A 3-step LoRA run that saves its adapter (and, the preset having no folder, its base weights)."""
    from bigtune.run.training import train

    run = tmp_path_factory.mktemp("infer-run") / "lora"
    # A large lr so the adapters move visibly away from their zero-initialised B matrices.
    over = tiny_overrides(
        run,
        **{
            "peft.method": "lora",
            "checkpoint.save_model": True,
            "memory.plan": False,
            "memory.every_steps": 1000,
            "optim.lr": 0.05,
        },
    )
    summary = train({}, over, quiet_recipe=True)
    assert summary["status"] == "ok"
    return run


@pytest.fixture
def eval_data(tmp_path) -> Path:
    recs = [
        {
            "instruction": f"Name fruit number {i}.",
            "input": "" if i % 2 else "a list",
            "output": f"Fruit {i} is " + "apple " * (i + 1),
        }
        for i in range(5)
    ]
    recs.insert(2, {"instruction": "no output here"})  # skipped: missing 'output'
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


# -- loading ----------------------------------------------------------------------------------------


def test_loaded_model_is_ready_for_batched_generation(loaded):
    model, tok = loaded
    assert not model.training
    assert tok.padding_side == "left" and tok.pad_token is not None


def test_pad_token_falls_back_to_eos(tmp_path, model_dir):
    d = tmp_path / "nopad"
    shutil.copytree(model_dir, d)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("pad_token", None)
    cfg_path.write_text(json.dumps(cfg))
    special = d / "special_tokens_map.json"
    if special.exists():
        m = json.loads(special.read_text())
        m.pop("pad_token", None)
        special.write_text(json.dumps(m))
    _, tok = load_for_inference(str(d), device="cpu")
    assert tok.pad_token == tok.eos_token == "</s>"


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda p: p / "does-not-exist", "no such file or folder"),
        (lambda p: (p / "file.txt").write_text("x") and p / "file.txt", "is a file"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "neither a model folder"),
        (
            lambda p: (p / "run").mkdir() or (p / "run" / "recipe.yaml").write_text("name: x\n") and p / "run",
            "checkpoint.save_model=true",
        ),
    ],
)
def test_bad_paths_raise_infer_error_with_a_fix(tmp_path, make, fragment):
    path = make(tmp_path)
    with pytest.raises(InferError, match=fragment) as info:
        load_for_inference(str(path), device="cpu")
    assert isinstance(info.value, ValueError)


def test_pickle_only_folder_is_refused(tmp_path, model_dir):
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(model_dir / "config.json", d / "config.json")
    (d / "pytorch_model.bin").write_bytes(b"not really")
    with pytest.raises(InferError, match="safetensors"):
        load_for_inference(str(d), device="cpu")


def test_run_directory_with_full_model(tmp_path, model_dir, loaded):
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text("name: demo\n")
    shutil.copytree(model_dir, run / "model")
    model, tok = load_for_inference(str(run), device="cpu")
    ids = torch.tensor([[1, 50, 60, 70]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded[0](input_ids=ids).logits)
    assert tok.padding_side == "left"


def test_adapter_run_matches_peft_on_base_plus_adapter(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert (lora_run / "adapter" / "adapter_config.json").is_file() and (lora_run / "base").is_dir()
    model, tok = load_for_inference(str(lora_run), device="cpu")
    assert isinstance(model, PeftModel) and not model.training
    assert tok.padding_side == "left"
    # not merged: the LoRA layers are still there
    assert any("lora_A" in n for n, _ in model.named_parameters())

    base = AutoModelForCausalLM.from_pretrained(str(lora_run / "base"), dtype=torch.float32, use_safetensors=True)
    ref = PeftModel.from_pretrained(base, str(lora_run / "adapter")).eval()
    direct, _ = load_for_inference(str(lora_run / "adapter"), device="cpu")  # the adapter folder itself
    ids = torch.tensor([[1, 40, 41, 42, 43, 44], [1, 100, 200, 300, 400, 500]])
    with torch.no_grad():
        got = model(input_ids=ids).logits
        want = ref(input_ids=ids).logits
        assert torch.equal(got, want)
        assert torch.equal(direct(input_ids=ids).logits, want)
        with ref.disable_adapter():
            plain = ref(input_ids=ids).logits
    assert (got - plain).abs().max() > 1e-4  # the adapter is really applied

    out = generate(model, tok, ["Hello", "How do I boil an egg?"], max_new_tokens=4, instruction_format=True)
    assert len(out) == 2 and all(isinstance(o, str) for o in out)


def test_adapter_without_reachable_base_says_how_to_fix(tmp_path, lora_run):
    lone = tmp_path / "lone-adapter"
    shutil.copytree(lora_run / "adapter", lone)
    with pytest.raises(InferError, match="base_model_name_or_path"):
        load_for_inference(str(lone), device="cpu")
    run = tmp_path / "run-without-base"
    run.mkdir()
    shutil.copy(lora_run / "recipe.yaml", run / "recipe.yaml")
    shutil.copytree(lora_run / "adapter", run / "adapter")
    with pytest.raises(InferError, match="preset 'tiny-llama'.*checkpoint.save_model=true"):
        load_for_inference(str(run), device="cpu")


# -- generation -------------------------------------------------------------------------------------


def test_greedy_is_deterministic_ordered_and_batch_size_invariant(loaded):
    model, tok = loaded
    one = generate(model, tok, PROMPTS, max_new_tokens=8, batch_size=1)
    four = generate(model, tok, PROMPTS, max_new_tokens=8, batch_size=4)
    again = generate(model, tok, PROMPTS, max_new_tokens=8, batch_size=4)
    assert len(one) == len(PROMPTS) and all(isinstance(o, str) for o in one)
    assert one == four == again
    assert any(o for o in one)
    # order: each output belongs to its own prompt, whatever else is in the batch
    for i in (0, 3):
        assert generate(model, tok, [PROMPTS[i]], max_new_tokens=8) == [one[i]]
    assert generate(model, tok, PROMPTS[::-1], max_new_tokens=8, batch_size=3) == one[::-1]


def test_left_padding_continues_the_prompt_like_an_unpadded_forward(loaded):
    model, tok = loaded
    ids = generate_ids(model, tok, PROMPTS, max_new_tokens=1, batch_size=len(PROMPTS))
    for p, got in zip(PROMPTS, ids):
        x = torch.tensor([[tok.bos_token_id] + tok(p, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            nxt = int(model(input_ids=x).logits[0, -1].argmax())
        assert got in ([nxt], []) and (got or nxt == tok.eos_token_id)


def test_max_new_tokens_bounds_the_output(loaded):
    model, tok = loaded
    short = generate_ids(model, tok, PROMPTS, max_new_tokens=3, batch_size=2)
    long = generate_ids(model, tok, PROMPTS, max_new_tokens=12, batch_size=2)
    for s, lg in zip(short, long):
        assert len(s) <= 3 and len(lg) <= 12
        assert lg[: len(s)] == s  # greedy: the short answer is the start of the long one
        assert tok.eos_token_id not in s and tok.pad_token_id not in s
    assert max(len(lg) for lg in long) > 3
    texts = generate(model, tok, PROMPTS, max_new_tokens=3, batch_size=2)
    assert texts == [tok.decode(s, skip_special_tokens=True) for s in short]


def test_sampling_repeats_with_the_same_seed_and_leaves_global_rng_alone(loaded):
    model, tok = loaded
    state = torch.get_rng_state()
    kw = dict(max_new_tokens=10, batch_size=2, do_sample=True, temperature=1.5, top_k=0, top_p=1.0)
    a = generate(model, tok, PROMPTS, seed=7, **kw)
    b = generate(model, tok, PROMPTS, seed=7, **kw)
    c = generate(model, tok, PROMPTS, seed=8, **kw)
    greedy = generate(model, tok, PROMPTS, max_new_tokens=10, batch_size=2)
    assert a == b
    assert a != c and a != greedy
    assert torch.equal(torch.get_rng_state(), state)
    top1 = generate(model, tok, PROMPTS, seed=3, max_new_tokens=10, batch_size=2, do_sample=True, top_k=1)
    assert top1 == greedy  # top-k 1 sampling is greedy decoding


def test_instruction_format_uses_the_training_template(loaded):
    model, tok = loaded
    wrapped = generate(model, tok, ["Name a fruit.", "Boil an egg."], max_new_tokens=5, instruction_format=True)
    by_hand = generate(model, tok, [format_prompt("Name a fruit."), format_prompt("Boil an egg.")], max_new_tokens=5)
    assert wrapped == by_hand


def test_generate_rejects_bad_arguments(loaded):
    model, tok = loaded
    assert generate(model, tok, [], max_new_tokens=4) == []
    with pytest.raises(InferError, match="list of strings"):
        generate(model, tok, "one string", max_new_tokens=4)
    with pytest.raises(InferError, match="max_new_tokens"):
        generate(model, tok, ["hi"], max_new_tokens=0)
    with pytest.raises(InferError, match="temperature"):
        generate(model, tok, ["hi"], do_sample=True, temperature=0.0)


# -- evaluation -------------------------------------------------------------------------------------


def _hand_loss(model, tok, path: Path, max_seq_length: int, mask_prompt: bool) -> tuple[float, int]:
    """Mean next-token negative log-likelihood over target tokens, one unpadded sample at a time."""
    examples, _ = build_examples(
        DataConfig(source=str(path), max_seq_length=max_seq_length, mask_prompt=mask_prompt), tok, seed=0
    )
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            logits = model(input_ids=torch.tensor([ex.input_ids])).logits[0].double()
            logp = torch.log_softmax(logits, dim=-1)
            for pos in range(1, len(ex.input_ids)):
                if ex.labels[pos] != -100:
                    total -= float(logp[pos - 1, ex.labels[pos]])
                    count += 1
    return total / count, count


def test_evaluate_matches_a_hand_computed_token_mean(loaded, eval_data):
    model, tok = loaded
    res = evaluate(model, tok, str(eval_data), max_seq_length=80, batch_size=4)
    want, count = _hand_loss(model, tok, eval_data, 80, True)
    assert res["tokens"] == count
    assert res["loss"] == pytest.approx(want, rel=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(res["loss"]), rel=1e-12)
    assert res["samples"] == 5 and res["skipped"] == 1 and res["source"] == str(eval_data)
    # the same numbers whatever the batching (padding is not scored)
    res1 = evaluate(model, tok, str(eval_data), max_seq_length=80, batch_size=1)
    assert res1["tokens"] == res["tokens"] and res1["loss"] == pytest.approx(res["loss"], rel=1e-5)
    # scoring the prompt too: more tokens, again the hand-computed mean
    full = evaluate(model, tok, str(eval_data), max_seq_length=80, batch_size=3, mask_prompt=False)
    want_full, count_full = _hand_loss(model, tok, eval_data, 80, False)
    assert full["tokens"] == count_full > count
    assert full["loss"] == pytest.approx(want_full, rel=1e-5)


# -- command line -----------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bigtune")
    add_cli(ap.add_subparsers(dest="verb"))
    return ap


def test_cli_generate_writes_jsonl_and_csv_in_order(tmp_path, model_dir, loaded):
    model, tok = loaded
    want = generate(model, tok, PROMPTS[:3], max_new_tokens=4)
    out = tmp_path / "out" / "gen.jsonl"
    args = _parser().parse_args(
        [
            "generate",
            "--model",
            str(model_dir),
            *PROMPTS[:3],
            "--max-new-tokens",
            "4",
            "--batch-size",
            "2",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    assert args.func(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [{"prompt": p, "output": o} for p, o in zip(PROMPTS[:3], want)]
    assert not list(out.parent.glob(".*.tmp"))

    out_csv = tmp_path / "gen.csv"
    args = _parser().parse_args(
        ["generate", "--model", str(model_dir), *PROMPTS[:3], "--max-new-tokens", "4", "--out", str(out_csv)]
    )
    assert args.func(args) == 0
    with out_csv.open(newline="") as fh:
        assert [(r["prompt"], r["output"]) for r in csv.DictReader(fh)] == list(zip(PROMPTS[:3], want))


def test_cli_generate_reads_prompt_files(tmp_path, model_dir, loaded, capsys):
    model, tok = loaded
    txt = tmp_path / "prompts.txt"
    txt.write_text("Name a fruit.\n\nBoil an egg.\n")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(
        json.dumps({"instruction": "Translate.", "input": "bonjour"})
        + "\n"
        + json.dumps({"prompt": "Once upon a time"})
        + "\n"
    )
    out = tmp_path / "o.jsonl"
    args = _parser().parse_args(
        [
            "generate",
            "--model",
            str(model_dir),
            "--file",
            str(jsonl),
            "--instruction",
            "--max-new-tokens",
            "3",
            "--out",
            str(out),
        ]
    )
    assert args.func(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    want = generate(
        model, tok, [format_prompt("Translate.", "bonjour"), format_prompt("Once upon a time")], max_new_tokens=3
    )
    assert [r["prompt"] for r in rows] == ["Translate.", "Once upon a time"]
    assert [r["output"] for r in rows] == want

    args = _parser().parse_args(
        ["generate", "--model", str(model_dir), "Hello", "--file", str(txt), "--max-new-tokens", "3"]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    want = generate(model, tok, ["Hello", "Name a fruit.", "Boil an egg."], max_new_tokens=3)
    for i, (p, o) in enumerate(zip(["Hello", "Name a fruit.", "Boil an egg."], want)):
        assert f"=== [{i}] {p}\n{o}\n" in printed


def test_cli_bad_input_raises_infer_error(tmp_path, model_dir):
    ap = _parser()
    cases = [
        ["generate", "--model", str(model_dir)],  # no prompts
        ["generate", "--model", str(model_dir), "hi", "--out", str(tmp_path / "o.txt")],  # unknown format
        ["generate", "--model", str(model_dir), "--file", str(tmp_path / "missing.txt")],
        ["generate", "--model", str(tmp_path / "nope"), "hi"],
        ["generate", "--model", str(model_dir), "hi", "--batch-size", "0"],
        ["eval", "--model", str(model_dir), "--batch-size", "0"],
    ]
    for argv in cases:
        args = ap.parse_args(argv)
        with pytest.raises(InferError):
            args.func(args)
    assert not (tmp_path / "o.txt").exists()


def test_cli_eval_prints_json_and_text(model_dir, loaded, eval_data, capsys):
    model, tok = loaded
    want = evaluate(model, tok, str(eval_data), max_seq_length=80, batch_size=2, mask_prompt=False)
    capsys.readouterr()
    args = _parser().parse_args(
        [
            "eval",
            "--model",
            str(model_dir),
            "--data",
            str(eval_data),
            "--max-seq-length",
            "80",
            "--batch-size",
            "2",
            "--no-mask-prompt",
            "--json",
        ]
    )
    assert args.func(args) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tokens"] == want["tokens"] and got["skipped"] == 1
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-9)
    args = _parser().parse_args(["eval", "--model", str(model_dir), "--data", str(eval_data), "--max-seq-length", "80"])
    assert args.func(args) == 0
    line = capsys.readouterr().out
    assert line.startswith("eval: ") and "perplexity" in line and "1 skipped" in line


def test_importing_infer_does_not_load_torch():
    code = "import sys, bigtune.use.generate, bigtune.cli.generate; print('torch' in sys.modules, 'transformers' in sys.modules)"
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False"]
