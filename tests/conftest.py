"""Shared fixtures: tiny, fast recipes (the same code path as real runs) and a CLI runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tiny_overrides(run_dir: Path, **extra) -> dict:
    """A 2-layer Llama on the bundled data, short sequences, CPU, every step logged and measured."""
    base = {
        "model.name": "tiny-llama",
        "data.source": "demo",
        "data.max_seq_length": 64,
        "train.micro_batch_size": 4,
        "train.max_steps": 3,
        "train.max_epochs": None,
        "train.log_every_steps": 1,
        "memory.every_steps": 1,
        "checkpoint.save_model": False,
        "accelerator": "cpu",
        "output_dir": str(run_dir),
        "name": "test",
    }
    base.update(extra)
    return base


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run_cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "bigtune", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
