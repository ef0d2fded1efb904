"""CI hook: the throughput bench's CPU smoke mode runs both sides and prints their ratio."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from conftest import ROOT


def test_throughput_smoke_prints_both_sides_and_ratios(tmp_path):
    out = tmp_path / "throughput.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "throughput.py"), "--smoke", "--steps", "8",
                        "--warmup", "4", "--data", "real", "--json", str(out)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
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
