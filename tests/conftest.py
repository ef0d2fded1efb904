"""Shared fixtures: tiny, fast recipes (the same code path as real runs) and a CLI runner."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
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


def run_cli(
    *args: str, cwd: Path, timeout: float = HANG_GUARD_S, own_process: bool = False
) -> subprocess.CompletedProcess:
    """``bigtune ARGS`` run in ``cwd``: its exit code, stdout and stderr.

    A command of one process runs in this one (``cli.app.main``, as ``python -m bigtune`` calls it), with its
    own stdout, stderr, stdin, working folder and environment, all restored afterwards: starting a fresh Python
    costs about 10 s of imports (torch, transformers, Lightning, PEFT) on the suite's 2 cores, more than most
    commands take. ``own_process=True``, and any run over several ranks (Fabric's launcher starts the other
    ranks by running the process's own command line again), run as ``python -m bigtune`` in a subprocess."""
    if own_process or os.environ.get("BIGTUNE_TEST_SUBPROCESS") or _several_ranks(args, cwd):
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
        return subprocess.run(
            [sys.executable, "-m", "bigtune", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    return _run_in_process(list(args), cwd)


def _several_ranks(args: tuple[str, ...], cwd: Path) -> bool:
    """Whether ``bigtune train ARGS`` would start more than one process (the recipe it resolves, as train does)."""
    if not args or args[0] != "train":
        return False
    from bigtune.cli.app import _overrides, build_parser
    from bigtune.recipe import load_recipe

    try:
        ns = build_parser().parse_args(list(args))
        with contextlib.chdir(cwd):
            over = _overrides(ns)
            if ns.resume:
                saved = Path(ns.resume) / "recipe.yaml"
                r = load_recipe(ns.recipe if ns.recipe is not None else saved, over, check=False)
            else:
                r = load_recipe(ns.recipe, over, check=False)
    except BaseException:  # noqa: BLE001 - a bad command line: the command itself says what is wrong
        return False
    return r.world_size > 1


def _run_in_process(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    import io
    import logging
    import traceback
    import warnings

    from bigtune.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    env, path, threads = dict(os.environ), list(sys.path), torch.get_num_threads()
    dtype, deterministic = torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled()
    stdin = sys.stdin
    # Handlers made at import time (Lightning's console handler) hold the stderr of the moment a library was
    # first imported, perhaps an earlier test's capture, closed since; a fresh process's would hold its own.
    handlers = [
        h
        for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        for h in getattr(lg, "handlers", [])
        if type(h) is logging.StreamHandler
    ]
    streams = [h.stream for h in handlers]
    for h in handlers:  # assigned, not setStream: that flushes the old stream, which may be closed
        h.stream = out if h.stream is sys.__stdout__ else err
    try:
        # catch_warnings: each command shows its own warnings once, as a fresh process would
        with (
            contextlib.chdir(cwd),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            warnings.catch_warnings(),
        ):
            sys.stdin = io.StringIO("")
            try:
                code = main(argv)
            except SystemExit as e:  # argparse's errors and --help
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if e.code is not None and not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)
            except BaseException:  # noqa: BLE001 - what `python -m bigtune` would print before exiting 1
                traceback.print_exc()
                code = 1
    finally:
        sys.stdin = stdin
        for h, stream in zip(handlers, streams):
            h.stream = stream
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        torch.use_deterministic_algorithms(deterministic)
    return subprocess.CompletedProcess(["bigtune", *argv], code, out.getvalue(), err.getvalue())


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


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A real one-node Slurm cluster (tests/slurm_cluster.py), shared by the tests that need one: the environment
    its commands need (SLURM_CONF). Skips with the reason where Slurm cannot run here."""
    from slurm_cluster import one_node_cluster

    with one_node_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield env


class MlflowServer:
    """`mlflow server` on a free port of 127.0.0.1 with a SQLite store, in its own process group (stopped as a
    group). ``url`` waits until it answers /health, starting it again if a test stopped it."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.start()

    def start(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = (self.folder / f"server-{self.port}.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port)]
            + ["--workers", "1", "--backend-store-uri", f"sqlite:///{self.folder / 'mlflow.db'}"]
            + ["--artifacts-destination", str(self.folder / "artifacts")],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=self.folder,
            start_new_session=True,
        )
        self._ready = False

    @property
    def url(self) -> str:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 180  # a bound, not a timing: a loaded CI machine boots it slowly
        while not self._ready:
            assert self.proc.poll() is None, (self.folder / f"server-{self.port}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not answer /health within 180 s"
            try:
                self._ready = urllib.request.urlopen(base + "/health", timeout=2).status == 200
            except OSError:
                time.sleep(0.2)
        return base

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # uvicorn's graceful shutdown can take long; nothing here needs it
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One MLflow tracking server for the session (per xdist worker), shared by the tracking and service tests;
    started when first asked for, so a module asks early and lets it boot while its first tests run."""
    pytest.importorskip("mlflow", reason="pip install -e '.[test]' (or 'bigtune[mlflow]')")
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def one_thread(monkeypatch):
    """torch on one intra-op thread, and the CLI subprocesses too, whatever an earlier test set: tiny models
    gain nothing from more, and on a busy 2-core machine spinning OpenMP threads made the tiny BLIP-2's steps up
    to 100x slower. For a module: ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(before)


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
