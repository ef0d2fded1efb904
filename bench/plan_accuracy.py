"""Planner accuracy on the GPU this runs on: measured peak memory per category vs `bigtune plan`.

    python bench/plan_accuracy.py [--quick] [--only NAME ...] [--out bench/results]

Each case trains a real architecture with random weights (model.init=random: no download) for a few
steps on full-length synthetic text, in its own process so an OOM is a result, then reads the run's
summary.json: measured per-phase categories and peak allocated/reserved beside the plan's prediction
for the same batch shape. Prints a table and the median / worst absolute error of peak allocated, and
writes bench/results/plan_accuracy-<gpu>.json with the command. Needs a CUDA GPU; on a CPU it says so
and exits 0 without results (use the CPU tests for the CPU path).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINYLLAMA = "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T"

# name: recipe overrides (every case: random init, seq 512, 4 steps, memory every step)
CASES = {
    "tinyllama-bf16true-adamw-b4": {"model.name": TINYLLAMA, "precision": "bf16-true", "train.micro_batch_size": 4},
    "tinyllama-32true-adamw-b2": {"model.name": TINYLLAMA, "precision": "32-true", "train.micro_batch_size": 2},
    "tinyllama-bf16mixed-adamw-b4": {"model.name": TINYLLAMA, "precision": "bf16-mixed", "train.micro_batch_size": 4},
    "tinyllama-bf16true-sgd-b8": {"model.name": TINYLLAMA, "precision": "bf16-true", "optim.name": "sgd",
                                  "train.micro_batch_size": 8},
    "tinyllama-bf16true-adamw-ckpt-b8": {"model.name": TINYLLAMA, "precision": "bf16-true",
                                         "train.activation_checkpointing": True, "train.micro_batch_size": 8},
    "tinyllama-bf16true-adamw-b4-acc2": {"model.name": TINYLLAMA, "precision": "bf16-true",
                                         "train.micro_batch_size": 4, "train.accumulate_grad_batches": 2},
    "opt1.3b-bf16true-adamw-b4": {"model.name": "facebook/opt-1.3b", "precision": "bf16-true",
                                  "train.micro_batch_size": 4},
    "openllama3b-bf16true-adamw-b2": {"model.name": "openlm-research/open_llama_3b", "precision": "bf16-true",
                                      "train.micro_batch_size": 2},
    "openllama7b-bf16true-sgd-b2": {"model.name": "openlm-research/open_llama_7b", "precision": "bf16-true",
                                    "optim.name": "sgd", "train.micro_batch_size": 2},
    "openllama7b-bf16true-adamw-ckpt-b4": {"model.name": "openlm-research/open_llama_7b", "precision": "bf16-true",
                                           "train.activation_checkpointing": True, "train.micro_batch_size": 4},
}
QUICK = ["tinyllama-bf16true-adamw-b4", "tinyllama-32true-adamw-b2", "tinyllama-bf16true-adamw-ckpt-b8"]


def run_case(name: str, over: dict, data: Path, work: Path, steps: int) -> dict:
    out_dir = work / name
    base = {"model.init": "random", "data.source": str(data), "data.max_seq_length": 512, "train.max_steps": steps,
            "train.max_epochs": None, "memory.every_steps": 1, "checkpoint.save_model": False, "accelerator": "cuda",
            "output_dir": str(out_dir), "name": name, "train.log_every_steps": 1}
    base.update(over)
    args = [sys.executable, "-m", "bigtune", "train"]
    for k, v in base.items():
        args += ["--set", f"{k}={'null' if v is None else v}"]
    t0 = time.perf_counter()
    res = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    row: dict = {"case": name, "overrides": over, "exit_code": res.returncode, "seconds": time.perf_counter() - t0}
    summary_path = out_dir / "summary.json"
    if not summary_path.exists():
        row["status"] = "no-summary"
        row["stderr_tail"] = res.stderr[-2000:]
        return row
    s = json.loads(summary_path.read_text())
    row["status"] = s["status"]
    plan = s.get("plan") or {}
    row["measured_peak_allocated"] = plan.get("measured_peak_allocated")
    row["predicted_peak_allocated"] = plan.get("predicted_peak_allocated_like_for_like")
    row["peak_error_pct"] = plan.get("peak_error_pct")
    row["phases"] = plan.get("phases")
    row["measured_peak_reserved"] = s.get("peak_reserved_bytes")
    row["predicted_peak_total"] = plan.get("predicted_peak_total")
    row["tokens_per_s"] = s.get("tokens_per_s")
    row["mfu"] = s.get("mfu")
    row["step_time_s"] = s.get("step_time_s")
    if s["status"] == "oom":
        row["oom"] = s.get("oom")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="three TinyLlama cases only")
    ap.add_argument("--only", nargs="*", help="case names to run")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("plan_accuracy: no CUDA GPU here; nothing measured (the CPU path is checked by tests/test_planner.py)")
        return 0
    names = args.only or (QUICK if args.quick else list(CASES))
    gpu_name = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        data = work / "long.jsonl"
        # Every record is longer than 512 tokens: all micro-batches are full length, no padding.
        data.write_text("".join(json.dumps({"text": f"sample {i}: " + "a plate of tomato soup with basil. " * 120})
                                + "\n" for i in range(256)))
        rows = []
        for name in names:
            row = run_case(name, CASES[name], data, work, args.steps)
            rows.append(row)
            _write(args.out, gpu_name, rows)  # after every case: a time limit loses nothing finished
            err = row.get("peak_error_pct")
            print(f"{name:<40} {row['status']:<6} measured {_gib(row.get('measured_peak_allocated'))} "
                  f"predicted {_gib(row.get('predicted_peak_allocated'))} "
                  f"error {'-' if err is None else f'{err:+.2f}%'}  reserved {_gib(row.get('measured_peak_reserved'))}"
                  f"  tok/s {row.get('tokens_per_s') or 0:,.0f}", flush=True)
    result, path = _write(args.out, gpu_name, rows)
    print(f"peak allocated error over {result['cases_compared']} cases: median {result['median_abs_error_pct']}, "
          f"worst {result['worst_abs_error_pct']}")
    print(f"wrote {path}")
    return 0


def _write(out_dir: str, gpu_name: str, rows: list[dict]) -> tuple[dict, Path]:
    import torch

    errs = [abs(r["peak_error_pct"]) for r in rows if r.get("peak_error_pct") is not None]
    result = {"gpu": gpu_name, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
              "command": "python bench/plan_accuracy.py " + " ".join(sys.argv[1:]),
              "median_abs_error_pct": statistics.median(errs) if errs else None,
              "worst_abs_error_pct": max(errs) if errs else None, "cases_compared": len(errs), "cases": rows}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    slug = gpu_name.lower().replace("nvidia", "").strip().replace(" ", "-")
    path = out / f"plan_accuracy-{slug}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)
    return result, path


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:7.2f} GiB"


if __name__ == "__main__":
    sys.exit(main())
