"""Shared fixtures: tiny, fast recipes (the same code path as real runs) and a CLI runner."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# One compute thread per process: the suite's xdist workers (README: -n 2) share CI's 2 cores, and so do the
# CLI and rank subprocesses the tests start (they inherit the environment). With torch's default of one thread
# per core in every process the cores are oversubscribed and its OpenMP threads spin while they wait: two
# `bigtune train` demos run side by side took 66 s each, with OMP_NUM_THREADS=1 9.8 s each, 9.2 s alone
# (2026-12-02, this 2-core machine). Set before torch is imported; speed is measured in bench/, not here.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

# The planner's simulated steps are kept on disk (plan/step/simcache.py, keyed by every input and by bigtune's own
# source): the suite's workers and the CLI subprocesses its tests start share one folder, so a step that several
# tests plan is simulated once per code version. Outside the repository, kept between runs.
os.environ.setdefault(
    "BIGTUNE_SIM_CACHE",
    os.path.join(
        tempfile.gettempdir(),
        "bigtune-test-sims-" + hashlib.sha1(str(Path(__file__).resolve()).encode()).hexdigest()[:10],
    ),
)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

ROOT = Path(__file__).resolve().parents[1]
# A subprocess timeout guards against a hang, it does not time anything (speed lives in bench/): CI machines of
# this kind have run the whole suite 3x slower than on other days (a 2-rank load of a 268 M model took > 300 s).
HANG_GUARD_S = 1800
# Headless Chromium renders report.html and the docs' home page; .ci/run installs it where it can.
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
NO_CHROMIUM = (
    "no Chromium on this machine to render the page (apt-get install chromium; .ci/run installs it when it can)"
)


def chromium(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Headless Chromium with a throwaway profile, no network chatter, console messages on stderr."""
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-dev-shm-usage",
                f"--user-data-dir={profile}",
                "--enable-logging=stderr",
                "--v=0",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def console_messages(stderr: str) -> list[str]:
    """Console lines Chromium logged (a failed load, a script or parse error)."""
    return [ln for ln in stderr.splitlines() if ":CONSOLE" in ln]


def page_ink(png: Path, box: tuple[int, int, int, int] | None = None) -> tuple[float, set]:
    """Share of non-white pixels and the set of colours in ``png`` (optionally a box of it)."""
    from PIL import Image

    img = Image.open(png).convert("RGB")
    if box:
        img = img.crop(box)
    colours = img.getcolors(maxcolors=img.width * img.height)  # [(count, (r, g, b)), ...]
    white = sum(n for n, c in colours if c == (255, 255, 255))
    return 1 - white / (img.width * img.height), {c for _, c in colours}


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


def run_cli(*args: str, cwd: Path, timeout: float = HANG_GUARD_S) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "bigtune", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def set_args(over: dict) -> list[str]:
    """``--set key=value`` flags for ``over`` (None as null)."""
    return [a for k, v in over.items() for a in ("--set", f"{k}={'null' if v is None else v}")]


def train_cli(tmp_path: Path, name: str, common: dict, **over) -> Path:
    """``bigtune train`` in its own process (multi-rank runs spawn there) with ``common`` then ``over``
    applied; the run folder ``tmp_path/name``."""
    res = run_cli("train", *set_args({**common, "output_dir": str(tmp_path / name), **over}), cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return tmp_path / name


def run_losses(run: Path) -> list[float]:
    return [m["loss"] for m in read_jsonl(run / "metrics.jsonl")]


def same_weights(a: Path, b: Path, atol: float = 1e-5) -> None:
    """The two runs' saved models hold the same names and values (atol=0: bit for bit)."""
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "model" / "model.safetensors")), load_file(str(b / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0 if atol == 0 else 1e-4, atol=atol)


def resume_from_step_3(tmp_path: Path, ref: Path, common: dict, over: dict) -> Path:
    """A copy of the 6-step run ``ref`` with its last checkpoint removed, resumed with ``--resume``: it must
    start again at step 3. Returns the resumed run's folder."""
    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(ref, cut)
    last = cut / "checkpoints" / "step-000006.ckpt"
    shutil.rmtree(last) if last.is_dir() else last.unlink()
    res = run_cli("train", "--resume", str(cut), *set_args({**common, **over, "output_dir": str(cut)}), cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "at step 3" in res.stdout
    return cut


@pytest.fixture
def no_sim_cache(monkeypatch):
    """For a test that patches what a simulation runs: its steps are simulated, not read from the cache."""
    monkeypatch.setenv("BIGTUNE_SIM_CACHE", "off")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


# The fast tier (`pytest -m "not slow"`, docs/contributing.md) leaves out the tests marked slow in their file
# and those a timed run of the suite found slow (tests/slow_tests.txt, written by scripts/slow_tests.py).
_SLOW_LIST = ROOT / "tests" / "slow_tests.txt"


def pytest_collection_modifyitems(config, items):
    if not _SLOW_LIST.is_file():
        return
    slow = {line.strip() for line in _SLOW_LIST.read_text().splitlines() if line.strip() and not line.startswith("#")}
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
