"""Planner speed: `bigtune plan` of a 70B Llama config with --alternatives, timed end to end.

    python bench/plan_speed.py [--gpu h100-80gb] [--json OUT]

Runs the real CLI in a fresh process (imports included) ``--repeat`` times (default 3: this kind of VM's
speed drifts by tens of percent within an hour) and prints each wall time, the median and the slowest, how
many variants were evaluated and how many fit. Goal: < 10 s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = """name: llama-2-70b-full
model:
  name: meta-llama/Llama-2-70b-hf
data:
  max_seq_length: 512
train:
  micro_batch_size: 4
  global_batch_size: 32
precision: bf16-true
"""


REFERENCE = "import time; t = time.perf_counter(); import torch; s = 0\nfor i in range(10**7): s += i\nprint(time.perf_counter() - t)"


def machine_reference() -> float:
    """Seconds a fresh interpreter takes to import torch and add 10^7 integers (this machine's speed)."""
    res = subprocess.run([sys.executable, "-c", REFERENCE], capture_output=True, text=True, check=True)
    return float(res.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", default="h100-80gb")
    ap.add_argument("--repeat", type=int, default=3, help="runs to time (median and slowest reported)")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    walls = []
    with tempfile.TemporaryDirectory() as d:
        recipe = Path(d) / "llama-70b.yaml"
        recipe.write_text(RECIPE)
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        for _ in range(max(1, args.repeat)):
            t0 = time.perf_counter()
            res = subprocess.run(
                [sys.executable, "-m", "bigtune", "plan", str(recipe), "--gpu", args.gpu, "--alternatives", "--json"],
                capture_output=True,
                text=True,
                env=env,
            )
            walls.append(time.perf_counter() - t0)
            if res.returncode != 0:
                print(res.stderr)
                return 1
    reference = machine_reference()
    out = json.loads(res.stdout)
    evaluated = out["plan"].get("variants_evaluated")
    fitting = len(out["alternatives"])
    median = statistics.median(walls)
    result = {
        "seconds": median,
        "seconds_max": max(walls),
        "runs_s": [round(w, 2) for w in walls],
        "variants_evaluated": evaluated,
        "variants_fitting": fitting,
        "gpu": args.gpu,
        "cpu_count": os.cpu_count(),
        "machine_reference_s": round(reference, 2),
        "command": "python bench/plan_speed.py " + " ".join(sys.argv[1:]),
    }
    print(
        f"70B plan + alternatives: median {median:.1f} s, slowest {max(walls):.1f} s wall over {len(walls)} runs "
        f"({', '.join(f'{w:.1f}' for w in walls)}; goal < 10 s), {evaluated} variants evaluated, "
        f"{fitting} fit on {args.gpu}; machine reference (import torch + 10^7 additions) {reference:.1f} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
