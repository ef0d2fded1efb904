"""The lab's ladders (ladders/lab-single.yaml, lab-multi.yaml) and their --tiny mapping.

One test runs a subset of lab-single under --tiny for real (the shipped rungs' own definitions, plus a
rung forced out of memory by memory.cap_gib), checks that failures are recorded with their reasons while
the sweep goes on, and that a second run reuses what finished.
"""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from bigtune.cli.sweep import main as sweep_cli
from bigtune.sweep.ladder import load_sweep, read_sweep, validate
from bigtune.sweep.report import write_report

ROOT = Path(__file__).resolve().parents[1]
LAB_SINGLE = ROOT / "ladders" / "lab-single.yaml"
LAB_MULTI = ROOT / "ladders" / "lab-multi.yaml"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.mark.parametrize("tiny", [False, True])
def test_lab_single_ladder_has_the_lab_rungs(tiny):
    s = read_sweep(LAB_SINGLE)
    refused = validate(s, tiny)
    names = [v.name for v in s.variants]
    assert len(names) == 15 and names[0] == "01-baseline-fp32-bs64" and names[-1] == "15-qlora"
    over = {v.name: s.overrides_for(v, tiny) for v in s.variants}
    base = yaml.safe_load((ROOT / "recipes" / "blip2-opt-2.7b.yaml").read_text())
    assert base["model"]["name"] == "Salesforce/blip2-opt-2.7b" and base["train"]["micro_batch_size"] == 64
    # the lab's knobs, rung by rung
    assert over["02-bs16"]["train.micro_batch_size"] == 16
    assert over["03-bs16-accum4"]["train.accumulate_grad_batches"] == 4
    assert over["04-accum4-lr2e-5"]["optim.lr"] == 2.0e-5
    assert over["05-bf16-true"]["precision"] == "bf16-true" and over["06-bf16-mixed"]["precision"] == "bf16-mixed"
    assert over["09-xxl-bs1"]["train.micro_batch_size"] == 1
    assert over["10-sgd"]["optim.name"] == "sgd" and over["11-adam8bit-bs2"]["optim.name"] == "adam8bit"
    assert over["12-adam8bit-act-ckpt"]["train.activation_checkpointing"] is True
    assert over["13-deepspeed-cpu-offload"]["optim.name"] == "deepspeed_cpu_adam"
    assert over["13-deepspeed-cpu-offload"]["train.max_steps"] == 2
    assert over["14-lora"]["peft.method"] == "lora" and over["14-lora"]["peft.r"] == 16
    assert over["14-lora"]["peft.alpha"] == 32 and over["14-lora"]["precision"] == "32-true"
    assert over["15-qlora"]["model.quantize"] == "nf4" and over["15-qlora"]["train.micro_batch_size"] == 64
    t5 = [n for n in names if int(n[:2]) >= 8]
    for n in names:
        model = over[n]["model.name"] if "model.name" in over[n] else base["model"]["name"]
        if tiny:
            assert model == ("tiny-blip2-t5" if n in t5 else "tiny-blip2-opt"), n
            assert over[n]["accelerator"] == "cpu" and over[n]["train.max_steps"] <= 3
        else:
            assert model.startswith("Salesforce/blip2-"), n
            assert ("flan-t5-xxl" in model) == (n in t5), n
    if tiny:  # every rung whose model changes under --tiny says so in its results
        for v in s.variants:
            if v.name in t5 or v.name == "07-opt-6.7b":
                assert v.tiny_note and "tiny-blip2" in v.tiny_note, v.name
    # rungs that cannot run here are refused with the reason (recorded, not dropped); the rest validate
    expect_refused = set() if HAS_DEEPSPEED else {"13-deepspeed-cpu-offload"}
    assert set(refused) == expect_refused
    if not HAS_DEEPSPEED:
        assert "needs DeepSpeed" in refused["13-deepspeed-cpu-offload"][0]


@pytest.mark.parametrize("tiny", [False, True])
def test_lab_multi_ladder(tiny):
    s = load_sweep(LAB_MULTI, tiny=tiny)
    over = {v.name: s.overrides_for(v, tiny) for v in s.variants}
    assert list(over) == ["1-one-gpu", "2-ddp-x4-lr-x4", "3-fsdp-x4"]
    for o in over.values():
        assert o["precision"] == "bf16-true" and o["train.micro_batch_size"] == 16
        assert o["train.accumulate_grad_batches"] == 4 and o["optim.lr"] == 2.0e-5
    assert over["1-one-gpu"]["devices"] == 1
    ddp, fsdp = over["2-ddp-x4-lr-x4"], over["3-fsdp-x4"]
    assert ddp["strategy"] == "ddp" and ddp["optim.lr_scaling"] == "linear"
    assert fsdp["strategy"] == "fsdp" and fsdp["train.activation_checkpointing"] is True
    assert ddp["devices"] == fsdp["devices"] == (2 if tiny else 4)
    if tiny:
        assert ddp["accelerator"] == "cpu" and "x 2" in s.variants[1].tiny_note


def _subset_ladder(folder: Path) -> Path:
    """lab-single's own rungs 1 and 8, a copy of rung 1 squeezed into a 16 MiB device, and a copy of rung 5
    in 16-true, which a CPU cannot run (refused by the recipe checks)."""
    raw = yaml.safe_load(LAB_SINGLE.read_text())
    keep = {v["name"]: v for v in raw["variants"]}
    capped = {
        **keep["01-baseline-fp32-bs64"],
        "name": "01-capped-16mib",
        "note": "rung 1 on a device capped at 16 MiB (forced out of memory)",
    }
    capped["overrides"] = {**capped["overrides"], "memory.cap_gib": 16 / 1024}
    fp16 = {**keep["05-bf16-true"], "name": "05-fp16-true", "note": "rung 5 in 16-true (no fp16 on a CPU)"}
    fp16["overrides"] = {**fp16["overrides"], "precision": "16-true"}
    raw["variants"] = [capped, keep["01-baseline-fp32-bs64"], fp16, keep["08-flan-t5-xxl"]]
    raw["base"] = str((LAB_SINGLE.parent / raw["base"]).resolve())
    raw["name"] = "lab-single-subset"
    path = folder / "lab-single-subset.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_tiny_lab_single_subset_records_failures_and_reuses_finished(tmp_path, capsys):
    path = _subset_ladder(tmp_path)
    out = tmp_path / "out"
    rc = sweep_cli(["sweep", str(path), "--tiny", "--out", str(out), "--no-report"])
    printed = capsys.readouterr().out
    assert rc == 0  # every rung produced a result (ok, oom, refused with its reason): the sweep did its job
    doc = json.loads((out / "sweep.json").read_text())
    rows = {r["variant"]: r for r in doc["rows"]}
    assert list(rows) == ["01-capped-16mib", "01-baseline-fp32-bs64", "05-fp16-true", "08-flan-t5-xxl"]

    capped = rows["01-capped-16mib"]  # failed first; the sweep went on
    assert capped["status"] == "oom" and capped["exit_code"] == 3
    assert capped["oom"]["phase"] in ("forward", "backward", "optimizer") and capped["oom"]["message"]
    assert capped["capacity_bytes"] == int(16 / 1024 * 1024**3)
    fp16 = rows["05-fp16-true"]
    assert fp16["status"] == "refused" and "16-true" in fp16["error"]
    assert not (out / "05-fp16-true").exists()  # refused before anything ran
    assert "05-fp16-true" in printed and "refused" in printed
    for name, preset in (("01-baseline-fp32-bs64", "tiny-blip2-opt"), ("08-flan-t5-xxl", "tiny-blip2-t5")):
        r = rows[name]
        assert r["status"] == "ok" and r["steps"] == 3 and r["final_loss"] is not None, name
        assert r["peak_allocated_bytes"] > capped["capacity_bytes"], name  # so the cap really was exceeded
        assert r["overrides"]["model.name"] == preset
        recipe = yaml.safe_load((out / name / "recipe.yaml").read_text())
        assert recipe["model"]["name"] == preset and recipe["accelerator"] == "cpu"
    assert rows["08-flan-t5-xxl"]["tiny_note"].startswith("flan-t5-xxl -> tiny-blip2-t5")
    assert "tiny_note" not in rows["01-baseline-fp32-bs64"]

    stamps = {
        n: (out / n / "summary.json").stat().st_mtime_ns
        for n in ("01-capped-16mib", "01-baseline-fp32-bs64", "08-flan-t5-xxl")
    }
    rc = sweep_cli(["sweep", str(path), "--tiny", "--out", str(out), "--no-report"])
    again = {r["variant"]: r for r in json.loads((out / "sweep.json").read_text())["rows"]}
    assert rc == 0 and list(again) == list(rows)
    for n, t in stamps.items():
        assert again[n]["reused"] is True and (out / n / "summary.json").stat().st_mtime_ns == t, f"{n} ran again"
    assert again["05-fp16-true"]["status"] == "refused"
    assert "already finished" in capsys.readouterr().out

    # the report carries every rung, with why it did not finish and what --tiny changed
    write_report(out)
    table = {r["variant"]: r for r in csv.DictReader((out / "results.csv").open())}
    assert list(table) == list(rows)
    assert table["05-fp16-true"]["status"] == "refused" and "16-true" in table["05-fp16-true"]["reason"]
    assert table["01-capped-16mib"]["reason"].startswith("out of memory in ")
    assert table["08-flan-t5-xxl"]["tiny_mapping"].startswith("flan-t5-xxl -> tiny-blip2-t5")
    assert table["01-baseline-fp32-bs64"]["reason"] == ""
    md = (out / "report.md").read_text()
    assert "refused (not run): precision" in md and "--tiny: flan-t5-xxl -> tiny-blip2-t5" in md


def test_plan_only_answers_which_rungs_fit_before_renting_the_gpu(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = sweep_cli(
        [
            "sweep",
            str(LAB_SINGLE),
            "--plan-only",
            "h100-80gb",
            "--json",
            "--only",
            "01-baseline-fp32-bs64",
            "09-xxl-bs1",
        ]
    )
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["gpu"] == "h100-sxm-80gb"
    plans = {p["variant"]: p for p in doc["plans"]}
    assert list(plans) == ["01-baseline-fp32-bs64", "09-xxl-bs1"]
    # rung 1 (BLIP-2 opt-2.7b, fp32, batch 64, every part trained as the lab's script does) does not fit,
    # as the lab reports even for its 94 GB H100; nor does Flan-T5-XXL's full fine-tune: its bf16
    # weights, gradients and Adam state alone (~12 B params x 8 bytes) exceed 80 GB at batch 1.
    assert plans["01-baseline-fp32-bs64"]["fits"] is False
    xxl = plans["09-xxl-bs1"]
    states = sum(xxl["phases"]["after_optimizer"][c] for c in ("parameters", "gradients", "optimizer_device"))
    assert xxl["fits"] is False and states > xxl["capacity"]
    assert not any(tmp_path.iterdir())  # nothing ran, nothing was written


def test_llm_multi_ladder_validates_and_plans(capsys, monkeypatch, tmp_path):
    path = ROOT / "ladders" / "llm-multi.yaml"
    s = read_sweep(path)
    assert [v.name for v in s.variants] == [
        "1-one-gpu",
        "2-ddp-x4",
        "3-fsdp-x4",
        "4-fsdp-x4-bs8",
        "5-13b-zero3-offload",
    ]
    refused = validate(s, True)
    assert list(refused) == ["5-13b-zero3-offload"]  # DeepSpeed needs CUDA: recorded, not dropped
    monkeypatch.chdir(tmp_path)
    rc = sweep_cli(
        ["sweep", str(path), "--plan-only", "h100-80gb", "--json", "--only", "2-ddp-x4", "5-13b-zero3-offload"]
    )
    plans = {p["variant"]: p for p in json.loads(capsys.readouterr().out)["plans"]}
    assert rc == 0
    ddp, zero3 = plans["2-ddp-x4"], plans["5-13b-zero3-offload"]
    # ZeRO-3 with offload keeps no parameters or Adam state on the GPU: a 13B model needs less device
    # memory per GPU than DDP's replicated 7B, and the offloaded state is reported as host RAM.
    last = zero3["phases"]["after_optimizer"]
    assert last["parameters"] == 0 and last["optimizer_device"] == 0 and last["optimizer_cpu"] > 0
    assert 0 < zero3["peak_allocated"] < ddp["peak_allocated"] and zero3["fits"] is True
    assert all(ph["allocated"] > 0 for ph in zero3["phases"].values())
