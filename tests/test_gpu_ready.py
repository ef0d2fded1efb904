"""What a GPU session runs, checked without a GPU: the benchmarks' plumbing (per-case time limits, the
time budget, resuming), the throughput presets (built, not trained), the GPU case matrix (every recipe
valid), a random-init BLIP-2 of a real architecture (no hub), and the CUDA-only measurement code
(torch.cuda mocked)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from conftest import ROOT

GIB = 2**30


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def pa():
    return _bench("plan_accuracy")


# -- bench/plan_accuracy.py ---------------------------------------------------------------------------


def test_a_case_past_its_time_limit_is_killed_with_its_children(pa, tmp_path):
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); print('started', flush=True); time.sleep(60)"
    )
    t0 = time.perf_counter()
    res = pa.run_process([sys.executable, "-c", code], timeout=3)
    assert res["timed_out"] and time.perf_counter() - t0 < 20 and "started" in res["stdout"]
    child = int(pid_file.read_text())
    time.sleep(0.2)
    try:  # the grandchild (a DataLoader worker, say) went with the group: gone or a zombie
        state = open(f"/proc/{child}/status").read().split("State:")[1].split()[0]
        assert state == "Z", state
    except FileNotFoundError:
        pass
    done = pa.run_process([sys.executable, "-c", "print('hi')"], timeout=30)
    assert done == {"returncode": 0, "stdout": "hi\n", "stderr": "", "timed_out": False}


def test_budget_skips_cases_that_would_not_finish_and_resume_runs_only_those(pa, tmp_path, monkeypatch):
    clock = {"t": 0.0}
    calls = []

    def fake_run_case(name, case, data, work, steps, timeout, accelerator, smoke, log=None):
        calls.append((name, timeout))
        clock["t"] += 20.0  # each case takes 20 s
        m, p = 1000, 1010
        return {
            "case": name,
            "expect": case.get("expect", "fit"),
            "status": "oom" if "oom" in name else "ok",
            "seconds": 20.0,
            "measured_peak_allocated": m,
            "predicted_peak_allocated": p,
            "peak_error_pct": pa.error_pct(p, m),
        }

    monkeypatch.setattr(pa, "run_case", fake_run_case)
    monkeypatch.setattr(pa, "_clock", lambda: clock["t"])
    # smoke estimates: 20, 20, 25, 20 s. Budget 50: two cases run, then 10 s is left for estimates of 25 and 20.
    assert pa.main(["--smoke", "--budget-s", "50", "--out", str(tmp_path)]) == 0
    out = tmp_path / "plan_accuracy-cpu-smoke.json"
    rec = json.loads(out.read_text())
    assert [r["status"] for r in rec["cases"]] == ["ok", "ok", "skipped", "skipped"]
    assert "time budget" in rec["cases"][2]["reason"]
    assert calls == [("smoke-tiny-llama-32true-adamw-b4", 50.0), ("smoke-tiny-opt-bf16true-sgd-ckpt-b4", 30.0)]
    assert rec["errors"]["peak_allocated"]["cases"] == 2 and rec["errors"]["peak_allocated"]["median_abs_pct"] == 1.0
    # the next call keeps the finished rows and runs the rest
    calls.clear()
    saved = tmp_path / "first.json"
    saved.write_text(out.read_text())
    assert pa.main(["--smoke", "--resume", str(saved), "--out", str(tmp_path)]) == 0
    assert [c[0] for c in calls] == ["smoke-tiny-blip2-opt-32true-adamw-b4-acc2", "smoke-tiny-llama-oom"]
    rec = json.loads(out.read_text())
    assert [r["case"] for r in rec["cases"]] == list(pa.SMOKE_CASES)
    assert rec["status_counts"] == {"ok": 3, "oom": 1} and rec["expectation_mismatches"] == []


def test_resume_tries_a_timeout_again_last_when_its_limit_was_cut_short(pa, tmp_path, monkeypatch):
    calls = []

    def fake_run_case(name, case, data, work, steps, timeout, accelerator, smoke, log=None):
        calls.append(name)
        return {"case": name, "expect": case.get("expect", "fit"), "status": "ok", "seconds": 1.0}

    monkeypatch.setattr(pa, "run_case", fake_run_case)
    names = list(pa.SMOKE_CASES)
    full = pa.SMOKE_CASES[names[1]]["timeout"]
    prev = {
        "cases": [
            {"case": names[0], "status": "ok"},
            {"case": names[1], "status": "timeout", "timeout_s": full - 1},  # the budget cut its limit
            {"case": names[2], "status": "timeout", "timeout_s": pa.SMOKE_CASES[names[2]]["timeout"]},  # its own
        ]
    }
    saved = tmp_path / "prev.json"
    saved.write_text(json.dumps(prev))
    assert pa.main(["--smoke", "--resume", str(saved), "--out", str(tmp_path)]) == 0
    assert calls == [names[3], names[1]]  # never tried first, the cut-short timeout last; a full one stays
    rows = {
        r["case"]: r["status"] for r in json.loads((tmp_path / "plan_accuracy-cpu-smoke.json").read_text())["cases"]
    }
    assert rows == {names[0]: "ok", names[1]: "ok", names[2]: "timeout", names[3]: "ok"}


def test_timed_steps_leave_out_the_memory_measured_ones(pa):
    metrics = [{"step": s, "step_time_s": 1.0 + s, "tokens_per_s": 100.0} for s in range(1, 9)]
    # every 4: steps 0, 1 and 4 (0-based) measured, i.e. rows 1, 2 and 5
    assert [m["step"] for m in pa.steady_steps(metrics)] == [3, 4, 6, 7, 8]
    assert pa.steady_steps(metrics[:2]) == metrics[1:2]  # a run that short: its last row
    row = pa.row_from_summary({"status": "ok", "plan": {}}, metrics)
    assert row["timed_steps"] == [3, 4, 6, 7, 8] and row["measured_step_time_s"] == 7.0


def test_a_case_whose_library_or_input_is_missing_is_a_skipped_row_and_the_run_goes_on(
    pa, tmp_path, monkeypatch, capsys
):
    calls = []

    def fake_run_case(name, case, data, work, steps, timeout, accelerator, smoke, log=None):
        calls.append(name)
        return {"case": name, "expect": case.get("expect", "fit"), "status": "ok", "seconds": 1.0}

    monkeypatch.setattr(pa, "run_case", fake_run_case)
    first = next(iter(pa.SMOKE_CASES))
    monkeypatch.setitem(pa.SMOKE_CASES, first, {**pa.SMOKE_CASES[first], "needs": ["no_such_library_xyz", "json"]})
    assert pa.missing_libraries(pa.SMOKE_CASES[first]) == ["no_such_library_xyz"]
    assert pa.main(["--smoke", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "plan_accuracy-cpu-smoke.json").read_text())
    row = rec["cases"][0]
    assert row["case"] == first and row["status"] == "skipped"
    assert row["reason"].startswith("no_such_library_xyz not installed")
    assert calls == list(pa.SMOKE_CASES)[1:]  # not started; every other case ran
    assert f"{first:<42} skipped: no_such_library_xyz not installed" in capsys.readouterr().out
    # the CPU pre-flight names it the same way instead of failing on the recipe
    assert pa.check_plans([first], pa.SMOKE_CASES, "h100-80gb", True) == 0
    assert "skipped: no_such_library_xyz not installed" in capsys.readouterr().out
    # an input that cannot be written (the text data here) stops only the cases that read it
    calls.clear()
    monkeypatch.setitem(pa.SMOKE_CASES, first, {k: v for k, v in pa.SMOKE_CASES[first].items() if k != "needs"})

    def broken(work):
        raise RuntimeError("disk full")

    monkeypatch.setattr(pa, "_long_text", broken)
    assert pa.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "plan_accuracy-cpu-smoke.json").read_text())["cases"]
    text = [n for n, c in pa.SMOKE_CASES.items() if c.get("kind", "llm") == "llm"]
    assert calls == [n for n in pa.SMOKE_CASES if n not in text] and len(calls) == 1
    for r in rows:
        if r["case"] in text:
            assert r["status"] == "skipped" and r["reason"] == "input llm could not be written: RuntimeError: disk full"


def test_row_from_a_cuda_summary_computes_every_error_from_its_numbers(pa):
    plan = {
        "measured_peak_allocated": 40 * GIB,
        "predicted_peak_allocated_like_for_like": 41 * GIB,
        "predicted_peak_allocated": 41 * GIB,
        "measured_peak_reserved": 44 * GIB,
        "predicted_peak_reserved_like_for_like": 43 * GIB,
        "measured_device_used": 45 * GIB,
        "predicted_peak_total_like_for_like": 43.5 * GIB,
        "predicted_fits": True,
        "predicted_step_time_s": 0.30,
        "predicted_tokens_per_s": 6800.0,
        "phases": {},
    }
    metrics = [
        {"step": i, "step_time_s": t, "tokens_per_s": 2048 / t, "mfu": 0.4}
        for i, t in enumerate([2.0, 0.5, 0.25, 0.25, 0.9, 0.25], start=1)  # step 5 measured memory: slower
    ]
    row = pa.row_from_summary({"status": "ok", "plan": plan, "device": {"name": "NVIDIA H100 80GB HBM3"}}, metrics)
    assert row["peak_error_pct"] == pytest.approx(2.5)
    assert row["reserved_error_pct"] == pytest.approx(100 * (43 - 44) / 44)
    assert row["total_error_pct"] == pytest.approx(100 * (43.5 - 45) / 45)
    assert row["measured_reserved_over_allocated"] == pytest.approx(1.1)
    assert row["measured_outside_allocator"] == 1 * GIB
    assert row["timed_steps"] == [3, 4, 6]  # neither the warm-up steps nor a memory-measured one are timed
    assert row["measured_step_time_s"] == pytest.approx(0.25) and row["measured_tokens_per_s"] == pytest.approx(8192)
    assert row["step_time_error_pct"] == pytest.approx(20.0)
    assert pa.slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3" and pa.slug("NVIDIA H200") == "h200"


def test_every_gpu_case_is_a_valid_recipe_and_the_matrix_covers_the_lab(pa, tmp_path):
    from bigtune.recipe import load_recipe

    data = pa.write_data(tmp_path)
    assert set(data) == pa.inputs_of(list(pa.CASES.values()))  # every kind and "@" folder a case reads
    # and every one was written: a writer that fails turns its cases into skipped rows on the GPU (a Qwen2.5-VL
    # processor writer once imported a helper that no longer existed, and only the GPU run would have said so)
    assert not [f"{k}: {v}" for k, v in data.items() if isinstance(v, pa.InputError)]
    seen, features = set(), set()
    with mock.patch("torch.cuda.is_available", return_value=True):  # validated as on the GPU machine
        for name, case in pa.CASES.items():
            # a case fits one accuracy call (its budget is 500 s)
            assert case["est"] < case["timeout"] <= 450 and case.get("expect", "fit") in ("fit", "oom")
            assert len(name) <= 42  # the printed table's column
            if pa.missing_libraries(case):  # bitsandbytes / torchao not installed here: the run skips it too
                continue
            recipe, over = pa.case_recipe(case, data, tmp_path / name, name, 6, "cuda", False)
            r = load_recipe(recipe, over)
            assert r.model.init == "random" and r.accelerator == "cuda" and not r.memory.oom_alternatives
            seen.add(
                (
                    r.model.family,
                    r.precision,
                    r.optim.name,
                    r.train.activation_checkpointing,
                    r.peft.method,
                    r.data.max_seq_length,
                    "blip2" in r.model.name,
                )
            )
            quant = f"{r.model.quantize}-{r.model.quant_backend}" if r.model.quantize != "none" else None
            features |= {r.optim.name, r.data.format, r.peft.method, quant, r.model.name.rsplit("/", 1)[-1]}
    lab = {x for x in seen if x[6]}
    assert {x[1] for x in lab} == {"bf16-true", "32-true", "bf16-mixed"} and all(x[5] == 50 for x in lab)
    assert any(x[3] for x in lab)  # checkpointing
    llm = {x for x in seen if x[0] == "causal-lm"}
    assert {"lora"} <= {x[4] for x in llm} and {"sgd", "adamw"} <= {x[2] for x in llm}
    assert "32-true" in {x[1] for x in llm}
    # what the project added since: chat data, a CPU-held optimizer, a chat VLM, Gemma 3, mixture of experts
    # (the 30B and the 8-layer cut in bf16-mixed), and, where their libraries are here, QLoRA, 8-bit AdamW, QDoRA
    assert {"chat", "cpu_offload_adamw", "Qwen2.5-VL-3B-Instruct", "gemma-3-4b-it", "Qwen3-30B-A3B"} <= features
    assert pa.MOE_8_LAYERS in features and ("causal-lm", "bf16-mixed") in {x[:2] for x in seen if x[4] == "lora"}
    for lib, wanted in (("bitsandbytes", {"nf4-bitsandbytes", "adamw8bit"}), ("torchao", {"nf4-torchao", "dora"})):
        if importlib.util.find_spec(lib) is not None:
            assert wanted <= features, (lib, features)
    assert list(pa.CASES)[:3] == [
        "tinyllama-bf16true-adamw-b4",
        "blip2opt2.7b-bf16true-adamw-b16-acc4",
        "openllama7b-bf16true-adamw-ckpt-b4",
    ]  # cheap sanity first, then what matters
    oom_checks = [n for n, c in pa.CASES.items() if c.get("expect") == "oom"]
    assert oom_checks and all(list(pa.CASES).index(n) >= len(pa.CASES) - 3 for n in oom_checks)  # run last


# -- bench/throughput.py -------------------------------------------------------------------------------


def test_throughput_gpu_presets_build_without_a_gpu(capsys):
    tp = _bench("throughput")
    for config in ("tinyllama-1.1b-full-bf16", "llama-7b-lora"):
        assert tp.main(["--config", config, "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert f"dry run ok: {config}" in out
        assert out.count("TrainingArguments ok") == 2 and "(fits)" in out
        for side in ("fixed bigtune", "fixed hf", "real  bigtune ", "real  hf", "real  bigtune+packing"):
            assert side in out, (side, out)
    assert "8,388,608 trainable" in out  # LoRA r16 on q and v of a 32-layer 4096-wide Llama


# -- random-init BLIP-2 of a real architecture (no hub) --------------------------------------------------


def test_random_init_blip2_gets_a_local_processor_at_the_models_image_size():
    from bigtune.data.images import ImageCaptionDataset, ImageCollator, TokenLayout, build_image_examples
    from bigtune.models.build import load_processor
    from bigtune.models.configs import resolve_config_name
    from bigtune.recipe import load_recipe

    r = load_recipe(ROOT / "recipes" / "blip2-opt-2.7b.yaml", {"model.init": "random", "data.num_train_samples": 8})
    with mock.patch.dict(os.environ, {"HF_HUB_OFFLINE": "1"}):
        proc = load_processor(r.model)
    cfg = resolve_config_name(r.model)
    layout = TokenLayout.for_model(proc, cfg)
    assert (layout.image_token_id, layout.num_query_tokens) == (50265, 32)
    examples, _ = build_image_examples(r.data, proc, layout, r.seed)
    batch = ImageCollator(layout)([ImageCaptionDataset(examples, proc.image_processor)[i] for i in range(2)])
    assert batch["pixel_values"].shape == (2, 3, 224, 224)  # the bundled 32-px photos, resized as the model wants
    caption = batch["input_ids"][:, 32:]
    assert (batch["input_ids"][:, :32] == 50265).all() and int(caption.max()) < 512


# -- CUDA-only measurement, torch.cuda mocked --------------------------------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch):
    state = {
        "allocated": 3 * GIB,
        "peak": 5 * GIB,
        "reserved": 6 * GIB,
        "peak_reserved": 7 * GIB,
        "free": 72 * GIB,
        "total": 80 * GIB,
        "resets": 0,
        "fraction": None,
    }
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * GIB)

    def reset(device=None):
        state["resets"] += 1

    def fraction(f, device=None):
        state["fraction"] = f

    for name, fn in {
        "memory_allocated": lambda d=None: state["allocated"],
        "max_memory_allocated": lambda d=None: state["peak"],
        "memory_reserved": lambda d=None: state["reserved"],
        "max_memory_reserved": lambda d=None: state["peak_reserved"],
        "mem_get_info": lambda d=None: (state["free"], state["total"]),
        "reset_peak_memory_stats": reset,
        "set_per_process_memory_fraction": fraction,
        "get_device_properties": lambda d=None: props,
    }.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    return state


def test_cuda_snapshot_reads_the_allocator_and_the_whole_device(fake_cuda):
    from bigtune.memory.monitor import MemoryMonitor, gather_snapshots

    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    mon = MemoryMonitor(torch.device("cuda"), cap_bytes=40 * GIB)
    assert fake_cuda["fraction"] == 0.5 and mon.tracker is None  # the cap is a per-process limit on CUDA
    mon.begin_step(model, opt)
    assert fake_cuda["resets"] == 1
    s = mon.snapshot(1, "after_backward", model, opt)
    states = 4 * (256 * 256 + 256)
    # parameters and gradients from the tensors themselves; these CPU-held AdamW moments count as host state
    assert (s.parameters, s.gradients, s.optimizer_device) == (states, states, 0) and s.optimizer_cpu >= 2 * states
    assert (s.allocated, s.peak_allocated, s.reserved, s.peak_reserved) == (3 * GIB, 5 * GIB, 6 * GIB, 7 * GIB)
    assert s.activations == 3 * GIB - 2 * states and s.device_used == 8 * GIB and s.phase_peak is None
    assert s.to_dict()["device_used"] == 8 * GIB
    # several ranks: every field, the device's memory in use included, survives the gather
    fabric = SimpleNamespace(world_size=2, device=torch.device("cpu"), all_gather=lambda t: torch.stack([t, t + GIB]))
    per_rank = gather_snapshots(fabric, [s])
    assert per_rank[0][0].device_used == 8 * GIB and per_rank[1][0].device_used == 9 * GIB
    assert per_rank[1][0].peak_reserved == 8 * GIB and per_rank[0][0].reserved == 6 * GIB


def test_cuda_helpers_of_the_engine(fake_cuda, tmp_path):
    from bigtune.core.rundir import RunDir
    from bigtune.engine import loop as engine
    from bigtune.recipe import load_recipe
    from bigtune.run import compare

    cuda = torch.device("cuda")
    target = compare.target_for_device(cuda)
    assert target.device == "cuda" and target.gpu.key == "h100-sxm-80gb"
    assert compare.target_for_device(cuda, 40 * GIB).capacity_bytes == 40 * GIB
    assert engine.gpu_peak_flops(cuda, "bf16-true") == 989.5e12
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert engine.gpu_peak_flops(cuda, "32-true") == 494.5e12  # TF32 when PyTorch is told to use it
        torch.backends.cuda.matmul.allow_tf32 = False
        assert engine.gpu_peak_flops(cuda, "32-true") == 67e12
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    r = load_recipe({}, {"model.name": "tiny-llama"})
    assert engine.device_capacity(cuda, r) == 80 * GIB
    assert engine.device_info(cuda) == {
        "type": "cuda",
        "name": "NVIDIA H100 80GB HBM3",
        "memory_bytes": 80 * GIB,
        "count": 1,
    }
    run = RunDir(tmp_path)
    run.create()
    for used in (7 * GIB, 9 * GIB):
        run.append_jsonl(
            "memory.jsonl",
            {
                "step": 0,
                "phase": "after_backward",
                "peak_allocated": 5 * GIB,
                "peak_reserved": 7 * GIB,
                "device_used": used,
            },
        )
    res = engine.run_results(run, engine.LoopState(), "ok", 1.0)
    assert res["peak_reserved_bytes"] == 7 * GIB and res["peak_device_used_bytes"] == 9 * GIB


def test_compare_with_plan_on_cuda_numbers_reports_reserved_total_and_time():
    from bigtune.recipe import load_recipe
    from bigtune.run import compare

    r = load_recipe({}, {"model.name": "tiny-llama", "data.max_seq_length": 64, "train.micro_batch_size": 4})
    cats = (
        "parameters",
        "gradients",
        "optimizer_device",
        "optimizer_cpu",
        "activations",
        "allocated",
        "peak_allocated",
    )
    phases = {
        ph: {c: (i + 1) * GIB for c in cats}
        for i, ph in enumerate(("before_forward", "after_forward", "after_backward", "after_optimizer"))
    }
    p = SimpleNamespace(
        target="1× h100-sxm-80gb",
        peak_allocated=4 * GIB,
        peak_reserved=int(4.2 * GIB),
        peak_total=int(4.7 * GIB),
        fits=True,
        notes=[],
        phases=phases,
        step_time_s=0.05,
        tokens_per_s=5120.0,
    )
    snaps = [
        {
            "step": s,
            "phase": ph,
            **{c: v for c, v in phases[ph].items()},
            "peak_allocated": 4 * GIB - 2**20,
            "reserved": 4 * GIB,
            "peak_reserved": 5 * GIB if ph == "after_backward" else 4 * GIB,
            "device_used": int(5.6 * GIB),
            "batch_shape": [4, 64],
            "padded": False,
            "rank": 0,
        }
        for s in (0, 1)
        for ph in phases
    ]
    c = compare.compare_with_plan(p, r, torch.device("cuda"), snaps)
    assert "replanned_at_batch_shape" not in c  # full-length batches: no second plan
    assert c["measured_peak_reserved"] == 5 * GIB and c["measured_device_used"] == int(5.6 * GIB)
    assert c["reserved_error_pct"] == pytest.approx(100 * (int(4.2 * GIB) - 5 * GIB) / (5 * GIB))
    assert c["total_error_pct"] == pytest.approx(100 * (int(4.7 * GIB) - int(5.6 * GIB)) / int(5.6 * GIB))
    assert c["peak_error_pct"] == pytest.approx(100 * 2**20 / (4 * GIB - 2**20))
    assert c["predicted_step_time_s"] == 0.05 and c["predicted_fits"] is True
    assert c["phases"]["after_backward"]["peak_allocated"] == {"measured": 4 * GIB - 2**20, "predicted": 3 * GIB}
    text = compare.format_comparison(c)
    assert "peak reserved: measured 5.00 GiB" in text and "as nvidia-smi shows it" in text
    # a CPU run has neither line
    cpu = compare.compare_with_plan(
        SimpleNamespace(**{**vars(p), "peak_reserved": None, "step_time_s": None}),
        r,
        torch.device("cpu"),
        [{**s, "peak_reserved": None, "reserved": None, "device_used": None} for s in snaps],
    )
    text = compare.format_comparison(cpu)
    assert cpu["reserved_error_pct"] is None and "peak reserved" not in text and "nvidia-smi" not in text
