"""CI hook: the throughput bench's CPU smoke mode runs both sides and prints their ratio."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from conftest import HANG_GUARD_S, ROOT


def test_throughput_smoke_prints_both_sides_and_ratios(tmp_path):
    out = tmp_path / "throughput.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "throughput.py"),
            "--smoke",
            "--steps",
            "8",
            "--warmup",
            "4",
            "--data",
            "real",
            "--json",
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for section in ("[real data]", "[real data, bigtune with data.packing]"):
        assert section in p.stdout
    rows = re.findall(r"^(bigtune|hf)\s+([\d,]+)\s", p.stdout, re.M)
    assert [r[0] for r in rows] == ["bigtune", "hf", "bigtune", "hf"], p.stdout
    assert all(int(r[1].replace(",", "")) > 0 for r in rows)
    ratios = re.findall(r"ratio bigtune/hf: tokens/s ([\d.]+), peak allocated ([\d.]+)", p.stdout)
    assert len(ratios) == 2 and all(float(a) > 0 and float(b) > 0 for a, b in ratios), p.stdout
    rec = json.loads(out.read_text())
    res = rec["results"]["real"]
    assert rec["command"].startswith("python bench/throughput.py --smoke")
    assert res["tokens_per_s_ratio"] == res["bigtune"]["tokens_per_s"] / res["hf"]["tokens_per_s"]
    # Same model, data, optimizer and order: the two sides learn the same thing (mean loss over the run).
    assert abs(res["bigtune"]["mean_loss"] - res["hf"]["mean_loss"]) < 0.05


def test_plan_accuracy_smoke_runs_every_case_in_its_own_process_and_scores_the_plan(tmp_path):
    """bench/plan_accuracy.py --smoke: the GPU benchmark's machinery on the CPU (tiny presets, random init,
    one process per case, summary.json parsing, errors, an OOM row, the JSON written after each case).
    On a CPU the plan is the measurement by construction: the errors must be tiny, and computed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    log = tmp_path / "cases.log"
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "plan_accuracy.py"),
            "--smoke",
            "--out",
            str(tmp_path),
            "--case-log",
            str(log),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rec = json.loads((tmp_path / "plan_accuracy-cpu-smoke.json").read_text())
    rows = {r["case"]: r for r in rec["cases"]}
    assert list(rows) == [
        "smoke-tiny-llama-32true-adamw-b4",
        "smoke-tiny-opt-bf16true-sgd-ckpt-b4",
        "smoke-tiny-blip2-opt-32true-adamw-b4-acc2",
        "smoke-tiny-llama-oom",
    ]
    ok = [r for r in rec["cases"] if r["status"] == "ok"]
    assert len(ok) == 3
    for r in ok:
        # printed: one table line per case with its status and its error
        line = next(x for x in p.stdout.splitlines() if x.startswith(r["case"] + " "))
        assert " ok " in line and f"{r['peak_error_pct']:+6.1f}%" in line, line
        meas, pred = r["measured_peak_allocated"], r["predicted_peak_allocated"]
        assert meas > 0 and pred > 0
        assert r["peak_error_pct"] == 100.0 * (pred - meas) / meas
        # the CPU plan is the measurement: 0.2 % here (1 % for tiny-opt with transformers 5.17)
        assert abs(r["peak_error_pct"]) < 2.0, r
        assert r["replanned_at_batch_shape"] is None  # full-length synthetic data: the plan's own shape
        # model states per phase: exactly the measured bytes; every phase of the step is compared
        assert set(r["phases"]) == {"before_forward", "after_forward", "after_backward", "after_optimizer"}
        for phase, cats in r["phases"].items():
            for cat in ("parameters", "gradients", "optimizer_device"):
                assert cats[cat]["measured"] == cats[cat]["predicted"], (r["case"], phase, cat)
            assert cats["peak_allocated"]["measured"] > 0
        assert r["phases"]["after_backward"]["gradients"]["measured"] > 0
        assert r["measured_step_time_s"] > 0 and r["measured_tokens_per_s"] > 0 and r["timed_steps"] == [3]
        # no caching allocator, no roofline on a CPU
        assert r["measured_peak_reserved"] is None and r["predicted_step_time_s"] is None
    assert rows["smoke-tiny-blip2-opt-32true-adamw-b4-acc2"]["recipe"] == "recipes/blip2-opt-2.7b.yaml"
    oom = rows["smoke-tiny-llama-oom"]
    assert oom["status"] == "oom" and oom["expect"] == "oom" and oom["exit_code"] == 3
    assert "memory.cap_gib" in oom["oom"]["message"] and oom["oom"]["alternatives"] == []  # search switched off
    assert oom["peak_error_pct"] is None and oom["predicted_peak_total"] > 0
    # the summary is computed from the rows
    errs = [abs(r["peak_error_pct"]) for r in ok]
    assert rec["errors"]["peak_allocated"]["cases"] == rec["cases_compared"] == 3
    assert rec["median_abs_error_pct"] == sorted(errs)[1] and rec["worst_abs_error_pct"] == max(errs)
    assert rec["status_counts"] == {"ok": 3, "oom": 1} and rec["expectation_mismatches"] == []
    assert f"median |err| {rec['median_abs_error_pct']:.2f}%" in p.stdout
    assert rec["command"].startswith("python bench/plan_accuracy.py --smoke")
    assert log.read_text().count("===== smoke-") == 4 and "OUT OF MEMORY" in log.read_text()
    assert not list(tmp_path.glob("*.tmp"))  # written atomically
