"""The command line as a new user meets it: the demo, local model folders, and one clear error per mistake."""

from __future__ import annotations

import json
import re

from conftest import HANG_GUARD_S, ROOT, run_cli

FAST = [
    "--set",
    "train.max_steps=2",
    "--set",
    "train.max_epochs=null",
    "--set",
    "checkpoint.save_model=false",
    "--set",
    "data.max_seq_length=64",
]


def test_demo_runs_loss_falls_and_prints_memory_table(tmp_path):
    res = run_cli("train", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "# resolved recipe" not in out and "model: tiny-llama" in out  # the recipe is in runs/demo/recipe.yaml
    assert "before_forward" in out and "after_optimizer" in out and "peak" in out
    summary = json.loads((tmp_path / "runs" / "demo" / "summary.json").read_text())
    assert summary["status"] == "ok"
    assert summary["final_loss"] < 0.5 * summary["first_loss"], (summary["first_loss"], summary["final_loss"])
    for name in ("recipe.yaml", "metrics.jsonl", "metrics.csv", "memory.jsonl", "summary.json"):
        assert (tmp_path / "runs" / "demo" / name).is_file(), name
    # the exported model is a plain Hugging Face folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "demo" / "model")
    tok = AutoTokenizer.from_pretrained(tmp_path / "runs" / "demo" / "model")
    assert model.config.model_type == "llama" and tok.pad_token == "<pad>"
    # a second run does not overwrite the first
    res2 = run_cli("train", *FAST, cwd=tmp_path)
    assert res2.returncode == 0 and (tmp_path / "runs" / "demo-2" / "summary.json").is_file()


def _one_error(res, *fragments):
    assert res.returncode == 2, res.stdout + res.stderr
    err = res.stderr.strip()
    assert err.startswith("bigtune: error:"), err
    assert "Traceback" not in err
    for f in fragments:
        assert f in err, err


def test_misspelled_key(tmp_path):
    _one_error(
        run_cli("train", "--set", "train.micro_bach_size=2", cwd=tmp_path), "did you mean train.micro_batch_size"
    )
    assert not (tmp_path / "runs").exists()


def test_wrong_type(tmp_path):
    _one_error(run_cli("train", "--set", "train.max_steps=lots", cwd=tmp_path), "train.max_steps", "int")
    assert not (tmp_path / "runs").exists()


def test_missing_model_folder(tmp_path):
    _one_error(run_cli("train", "--model", "./models/nope", cwd=tmp_path), "model.name", "does not exist")
    assert not (tmp_path / "runs").exists()


def test_corrupt_jsonl_line(tmp_path):
    data = tmp_path / "data.jsonl"
    good = json.dumps({"instruction": "Say hi", "input": "", "output": "hi"})
    data.write_text(good + "\n" + good + '\n{"instruction": "broken", \n' + good + "\n")
    _one_error(run_cli("train", "--data", str(data), *FAST, cwd=tmp_path), str(data), "line 3")
    assert not (tmp_path / "runs").exists()


def test_bad_records_are_reported_not_fatal(tmp_path):
    data = tmp_path / "data.jsonl"
    rows = [{"instruction": "Say hi", "input": "", "output": "hi there"}] * 6
    rows.insert(2, {"instruction": "no output here"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = run_cli("train", "--data", str(data), *FAST, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "skipped record 2: missing 'output'" in res.stdout
    # --data on the demo recipe names the run after the model and the data file
    summary = json.loads((tmp_path / "runs" / "tiny-llama-data" / "summary.json").read_text())
    assert summary["data"]["skipped"] == 1 and summary["data"]["used"] == 6


def test_local_hf_folder_trains(tmp_path):
    from bigtune.core.presets import tiny_tokenizer
    from bigtune.models.build import build_model
    from bigtune.recipe import ModelConfig

    tok = tiny_tokenizer()
    folder = tmp_path / "my-model"
    build_model(ModelConfig(name="tiny-opt"), tok, "32-true", seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)
    res = run_cli("train", "--model", str(folder), *FAST, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((tmp_path / "runs" / "my-model" / "summary.json").read_text())  # named after the folder
    assert summary["status"] == "ok" and summary["recipe"]["model"]["name"] == str(folder)


def test_pickle_only_folder_is_refused(tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "pytorch_model.bin").write_bytes(b"not really")
    from bigtune.core.presets import tiny_tokenizer

    tiny_tokenizer().save_pretrained(folder)
    _one_error(run_cli("train", "--model", str(folder), *FAST, cwd=tmp_path), "pickle", "safetensors")
    assert not (tmp_path / "runs").exists()


def test_oom_exit_code_and_summary(tmp_path):
    res = run_cli("train", *FAST, "--set", "memory.cap_gib=0.004", cwd=tmp_path)
    assert res.returncode == 3, res.stdout + res.stderr
    assert "OUT OF MEMORY at step 0" in res.stdout and "try:" in res.stdout
    summary = json.loads((tmp_path / "runs" / "demo" / "summary.json").read_text())
    assert summary["status"] == "oom" and summary["oom"]["phase"] in ("forward", "backward", "optimizer")


def test_recipe_verb_prints_resolved_recipe_and_docs(tmp_path):
    res = run_cli(
        "recipe", str(ROOT / "recipes" / "tinyllama-full.yaml"), "--set", "precision=bf16-mixed", cwd=tmp_path
    )
    assert res.returncode == 0 and "precision: bf16-mixed" in res.stdout
    res = run_cli("recipe", "--docs", cwd=tmp_path)
    assert "| `train.micro_batch_size` |" in res.stdout


def test_import_is_light():
    import subprocess
    import sys

    code = "import sys, bigtune, bigtune.cli; print('lightning' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(ROOT / "src")}
    ).stdout.strip()
    assert out == "False False"


def test_unreachable_hub_is_known_at_once_and_loads_go_to_the_cache(monkeypatch, tmp_path):
    """No internet (a compute node): the hub's host is asked once; hub ids then load from the local cache
    only (a missing file fails at once instead of after minutes of retries); folders are untouched; a proxy
    is trusted without asking; HF_HUB_OFFLINE needs no question at all."""
    import bigtune.core.hub as models

    for var in models.PROXY_VARS + ("HF_HUB_OFFLINE",):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setattr(models, "_HUB_ANSWERS", None)
    assert models.hub_reachable() is False
    assert models.hub_kwargs("Salesforce/blip2-opt-2.7b") == {"local_files_only": True}
    assert models.hub_kwargs(str(tmp_path)) == {}

    monkeypatch.setattr(models, "_HUB_ANSWERS", None)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    assert models.hub_reachable() is True

    monkeypatch.setattr(models, "_HUB_ANSWERS", None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models.hub_reachable() is False


def test_plan_data_lengths_of_hub_model_and_data_offline_fails_at_once(tmp_path):
    """`plan --data-lengths` needs the real tokenizer; with the hub unreachable and nothing cached, one
    clear error that says the hub does not answer and how to bring the files, exit code 2."""
    import os
    import subprocess
    import sys

    from bigtune.core.hub import PROXY_VARS

    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE",) + PROXY_VARS}
    env.update(PYTHONPATH=str(ROOT / "src"), HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "bigtune",
            "plan",
            str(ROOT / "recipes" / "tinyllama-full.yaml"),
            "--gpu",
            "l4",
            "--data-lengths",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.startswith("bigtune: error:") and "Traceback" not in res.stderr
    assert "does not answer" in res.stderr and "local folder" in res.stderr
    # past the tokenizer (random init uses bigtune's own), the recipe's hub dataset: datasets' offline mode
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "bigtune",
            "plan",
            str(ROOT / "recipes" / "tinyllama-full.yaml"),
            "--gpu",
            "l4",
            "--data-lengths",
            "--set",
            "model.init=random",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "hf:mhenrichsen/alpaca_2k_test" in res.stderr and "OfflineModeIsEnabled" in res.stderr
    assert "save_to_disk" in res.stderr and "Traceback" not in res.stderr


def test_plan_gpus_n_plans_the_recipe_as_devices_n_trains_it(tmp_path):
    # A recipe with a global batch: on N GPUs the accumulation shrinks N-fold, so the step keeps its tokens
    # (and halves its time on 2 GPUs) — as `--set devices=N` and training on N GPUs do.
    recipe = tmp_path / "global.yaml"
    text = (
        (ROOT / "recipes" / "tiny-opt.yaml").read_text().replace("accumulate_grad_batches: 2", "global_batch_size: 32")
    )
    recipe.write_text(text)
    got = {}
    for name, flags in (("one", []), ("gpus", ["--gpus", "2"]), ("set", ["--set", "devices=2"])):
        res = run_cli("plan", str(recipe), "--gpu", "h100", *flags, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        got[name] = re.search(r"\(([\d,]+) tokens per optimizer step\)", res.stdout).group(1)
    assert got["gpus"] == got["set"] == got["one"]
