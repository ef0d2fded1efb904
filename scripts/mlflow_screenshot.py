"""The MLflow UI showing a bigtune run, as docs/img/mlflow-run.png (docs/how-to/tracking.md shows it).

Starts `mlflow server` (SQLite store, a throwaway folder, a free port), trains the tiny demo with
`tracking.backends: [mlflow]`, and photographs the run's page with headless Chromium. Run from the repository
root, with `pip install -e '.[test]'` and a Chromium on the PATH:

    python scripts/mlflow_screenshot.py [--page overview|model-metrics] [--out docs/img/mlflow-run.png]
"""

from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
        + ["--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}"]
        + ["--artifacts-destination", str(folder / "artifacts")],
        stdout=(folder / "server.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # stopped as a group: uvicorn runs a worker process under it
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit("mlflow server exited:\n" + (folder / "server.log").read_text()[-3000:])
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return proc, url
        except OSError:
            time.sleep(0.3)
    stop(proc)
    sys.exit("mlflow server did not answer within 180 s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def screenshot(url: str, out: Path) -> None:
    chromium = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)))
    with tempfile.TemporaryDirectory() as profile:
        res = subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars"]
            + ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
            + ["--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1500,1100"]
            # the UI is a JavaScript app that fetches the run after loading: give it virtual time to render
            + ["--virtual-time-budget=20000", f"--screenshot={out}", url],
            capture_output=True,
            text=True,
            timeout=300,
        )
    if res.returncode != 0 or not out.is_file():
        sys.exit(f"chromium failed ({res.returncode}):\n{res.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "mlflow-run.png")
    ap.add_argument("--page", choices=["overview", "model-metrics"], default="overview")
    args = ap.parse_args()
    from mlflow import MlflowClient

    import bigtune

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        proc, url = start_server(folder)
        try:
            summary = bigtune.train(
                None,  # the built-in demo, shortened: a few logged steps make the charts
                {
                    "name": "demo",
                    "train.max_epochs": None,
                    "train.max_steps": 40,
                    "train.log_every_steps": 4,
                    "memory.every_steps": 10,
                    "tracking.backends": ["mlflow"],
                    "tracking.mlflow_uri": url,
                    "tracking.experiment": "bigtune-demo",
                    "output_dir": str(folder / "runs" / "demo"),
                },
            )
            assert summary["status"] == "ok", summary["status"]
            client = MlflowClient(url)
            exp = client.get_experiment_by_name("bigtune-demo")
            (run,) = client.search_runs([exp.experiment_id])
            page = f"{url}/#/experiments/{exp.experiment_id}/runs/{run.info.run_id}"
            if args.page == "model-metrics":
                page += "/model-metrics"
            args.out.parent.mkdir(parents=True, exist_ok=True)
            screenshot(page, args.out)
            print(f"{args.out}: {page}")
        finally:
            stop(proc)


if __name__ == "__main__":
    main()
