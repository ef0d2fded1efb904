"""The training service with an MLflow tracking server beside it (bigtune serve --mlflow-uri) and its web page: each
job is an MLflow run, named by the job and linked from its view; the page, in headless Chromium, shows a submitted
job run to its end with its loss and memory plots. One service on 127.0.0.1 (1 slot) and one tiny job of 2 steps
are shared by the tests; the MLflow server is the session's (conftest.py, SQLite store)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest

from bigtune.serve.service import ServeConfig, Service
from bigtune.serve.store import TERMINAL, Job
from conftest import CHROMIUM, NO_CHROMIUM, page_ink, read_jsonl
from test_serve import TINY, WAIT_S, Served

TWO_STEPS = {**TINY, "name": "tiny-web", "train": {**TINY["train"], "max_steps": 2}}


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, mlflow_server):
    root = tmp_path_factory.mktemp("serve-web")
    cfg = ServeConfig(state_dir=root / "state", slots=1, workdir=root, allowed_roots=(root,), tick_s=0.2,
                      mlflow_uri=mlflow_server.url, mlflow_experiment="serve-web")  # fmt: skip
    s = Served(cfg)
    try:
        yield s
    finally:
        service = s.server.service
        for job in service.store.jobs(states=("running",)):  # nothing of a failed test left running
            if job.handle:
                service.backend.release(job.handle)
        s.server.stop()


@pytest.fixture(scope="module")
def job_id(tracked) -> str:
    """alice's tiny job, submitted once for the module (the tests follow it while it runs, or wait for its end)."""
    res = tracked.submit("alice", recipe=TWO_STEPS)
    assert res.status_code == 201, res.text
    return res.json()["id"]


def _ended(job: dict) -> bool:
    return job["state"] in TERMINAL


# first: it follows the job from its submission
@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_the_page_in_headless_chromium_follows_a_job_until_it_ends(tracked, job_id, tmp_path):
    browser = DevTools()
    try:
        browser.open(tracked.url + "/")
        assert browser.evaluate("!document.getElementById('login').hidden"), "the page did not ask for a token"
        # the user types the token and sends the form, as in a browser
        browser.evaluate(f"document.getElementById('token').value = {json.dumps(tracked.tokens['alice'])}")
        browser.evaluate("document.getElementById('login').requestSubmit()")
        row = f"document.querySelector('tr[data-job=\"{job_id}\"]')"
        browser.wait_for(row, "the job listed")
        seen = set()
        deadline = time.monotonic() + WAIT_S
        while "succeeded" not in seen:
            state = browser.evaluate(f"{row}.querySelector('.state').textContent")
            seen.add(state)
            assert state not in ("failed", "cancelled"), state
            assert time.monotonic() < deadline, f"the page did not show the job succeed within {WAIT_S} s: {seen}"
            time.sleep(0.3)
        # the detail of the finished job: both plots drawn, the output, the MLflow link
        browser.wait_for("document.querySelectorAll('#loss-plot polyline, #memory-plot polyline').length >= 3",
                         "the plots drawn")  # fmt: skip
        dom = browser.evaluate("document.documentElement.outerHTML")
        png = tmp_path / "page.png"
        browser.screenshot(png)
    finally:
        browser.close()
    assert not browser.console, browser.console
    assert seen & {"queued", "running"}, f"the page never showed the job before it ended: {seen}"
    plots = dict(re.findall(r'<svg id="(\w+)-plot"[^>]*>(.*?)</svg>', dom, re.S))
    assert set(plots) == {"loss", "memory"}
    assert re.search(r'data-series="loss" data-count="2"', plots["loss"])
    assert 'data-series="measured peak"' in plots["memory"] and 'data-series="planned peak"' in plots["memory"]
    job = tracked.job(job_id)
    assert f'href="{job["mlflow"]["url"]}"' in dom.replace("&amp;", "&")
    assert "step 2 of 2" in dom and "succeeded: 2 steps" in dom  # the summary and the events
    assert tracked.tokens["alice"] not in dom  # the token is kept out of the page's markup
    ink, _ = page_ink(png, (0, 0, 1280, 1400))
    assert ink > 0.02, f"the page screenshot is nearly blank ({ink:.2%})"


def test_each_job_is_an_mlflow_run_named_by_the_job_and_linked_from_its_view(tracked, job_id, mlflow_server):
    import mlflow

    (job,) = tracked.wait([job_id], _ended, "finished")
    assert job["state"] == "succeeded", job["error"]
    url = tracked.cfg.mlflow_uri
    seen = job["mlflow"]
    assert seen and seen["tracking_uri"] == url and seen["experiment"] == "serve-web"
    c = mlflow.MlflowClient(tracking_uri=url)
    run = c.get_run(seen["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == job_id
    assert run.data.tags["bigtune.serve_job"] == job_id
    assert c.get_experiment(run.info.experiment_id).name == "serve-web"
    assert seen["experiment_id"] == run.info.experiment_id
    assert seen["url"] == f"{url}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    losses = [m["loss"] for m in read_jsonl(Path(job["run_dir"]) / "metrics.jsonl")]
    history = c.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [1, 2] and [m.value for m in history] == pytest.approx(losses)
    with urllib.request.urlopen(seen["url"].split("#")[0], timeout=30) as page:  # the MLflow UI at that address
        assert page.status == 200
    # the list shows it too (the web page reads the list)
    listed = tracked.call("GET", "/v1/jobs", "alice").json()["data"]
    assert [j["mlflow"]["run_id"] for j in listed if j["id"] == job_id] == [run.info.run_id]


def _job(recipe: dict, overrides: list[str]) -> Job:
    import yaml

    return Job(id="job-x", recipe_yaml=yaml.safe_dump(recipe), overrides_json=json.dumps(overrides))


def test_the_tracking_overrides_keep_the_recipes_trackers_and_experiment(tmp_path):
    service = Service(ServeConfig(state_dir=tmp_path, mlflow_uri="http://mlflow.lab:5000", mlflow_experiment="team"))
    try:
        assert service._tracking_sets(_job(TINY, [])) == [
            'tracking.backends=["mlflow"]',
            'tracking.mlflow_uri="http://mlflow.lab:5000"',
            'tracking.experiment="team"',
        ]
        own = {**TINY, "tracking": {"backends": ["tensorboard"], "experiment": "mine"}}
        assert service._tracking_sets(_job(own, [])) == [
            'tracking.backends=["tensorboard", "mlflow"]',
            'tracking.mlflow_uri="http://mlflow.lab:5000"',
        ]
        assert service._tracking_sets(_job(TINY, ["tracking.backends=[mlflow, wandb]"]))[0] == (
            'tracking.backends=["mlflow", "wandb"]'
        )
    finally:
        service.store.close()
    untracked = Service(ServeConfig(state_dir=tmp_path / "b"))
    assert untracked._tracking_sets(_job(TINY, [])) == []
    untracked.store.close()


def test_a_views_mlflow_link_never_shows_the_servers_login(tmp_path):
    from bigtune.serve.progress import mlflow_run

    entry = {"run_id": "r1", "tracking_uri": "https://bob:secret@mlflow.lab:8443", "experiment_id": "7"}
    (tmp_path / "tracking.json").write_text(json.dumps({"mlflow": entry}))
    seen = mlflow_run(tmp_path)
    assert seen["url"] == "https://mlflow.lab:8443/#/experiments/7/runs/r1" and "secret" not in json.dumps(seen)
    (tmp_path / "tracking.json").write_text(json.dumps({"mlflow": {"run_id": "r2", "tracking_uri": "sqlite:///m.db"}}))
    assert mlflow_run(tmp_path)["url"] is None  # no server, no page
    assert mlflow_run(tmp_path / "nowhere") is None


def test_the_metrics_route_gives_the_plots_their_series(tracked, job_id):
    (job,) = tracked.wait([job_id], _ended, "finished")
    m = tracked.call("GET", f"/v1/jobs/{job_id}/metrics", "alice").json()
    assert m["job_state"] == "succeeded" and [s["step"] for s in m["steps"]] == [1, 2]
    assert all(s["loss"] > 0 for s in m["steps"])
    assert (
        m["memory"] and max(s["peak_allocated"] for s in m["memory"]) == job["memory"]["measured_peak_allocated_bytes"]
    )
    assert m["planned_peak_allocated_bytes"] == job["memory"]["planned_peak_allocated_bytes"]
    thin = tracked.call("GET", f"/v1/jobs/{job_id}/metrics?max_points=2", "alice").json()
    assert len(thin["memory"]) <= 2 and thin["memory"][-1] == m["memory"][-1]
    assert tracked.call("GET", f"/v1/jobs/{job_id}/metrics", "bob").status_code == 403


class DevTools:
    """Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe: commands on its fd 3,
    answers on its fd 4, each a JSON message ending in a NUL byte). The page keeps the user's token in
    sessionStorage, which a plain --dump-dom run cannot fill: here the test sets it as the user would, in the page
    itself, never in a URL."""

    def __init__(self, timeout_s: float = 60.0):
        import os
        import queue
        import subprocess
        import tempfile
        import threading

        self.timeout_s = timeout_s
        self._profile = tempfile.TemporaryDirectory()
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--remote-debugging-pipe",
                 f"--user-data-dir={self._profile.name}", "--window-size=1280,1400", "about:blank"]  # fmt: skip

        def at_3_and_4() -> None:  # in the child: the pipe's ends where Chromium looks for them, inheritable
            ends = os.dup(to_browser_r), os.dup(from_browser_w)  # copies first: an end may itself be fd 3 or 4
            for fd, end in zip((3, 4), ends):
                os.dup2(end, fd)
                os.set_inheritable(fd, True)

        # close_fds=False: the two descriptors dup2 made must survive; Python's own are not inheritable (PEP 446)
        self.proc = subprocess.Popen([CHROMIUM, *flags], preexec_fn=at_3_and_4, close_fds=False,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._messages: queue.Queue = queue.Queue()
        self._next_id = 0
        self.console: list[str] = []  # console errors and uncaught exceptions of the page
        threading.Thread(target=self._read, daemon=True).start()
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Runtime.enable", session=True)

    def _read(self) -> None:
        import os

        buf = b""
        while chunk := os.read(self._from_browser, 65536):
            buf += chunk
            *whole, buf = buf.split(b"\0")
            for raw in whole:
                self._messages.put(json.loads(raw))
        self._messages.put(None)

    def send(self, method: str, params: dict | None = None, session: bool = False) -> dict:
        import os
        import queue

        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        try:
            os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        except BrokenPipeError:
            raise AssertionError(f"Chromium ended: {self.proc.stderr.read().decode()[-3000:]}") from None
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                got = self._messages.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"Chromium did not answer {method} within {self.timeout_s:.0f} s") from None
            assert got is not None, f"Chromium ended: {self.proc.stderr.read().decode()[-2000:]}"
            if got.get("method") == "Runtime.exceptionThrown":
                self.console.append(json.dumps(got["params"]["exceptionDetails"])[:500])
            elif got.get("method") == "Runtime.consoleAPICalled" and got["params"]["type"] in ("error", "assert"):
                self.console.append(json.dumps(got["params"]["args"])[:500])
            if got.get("id") == self._next_id:
                assert "error" not in got, f"{method}: {got['error']}"
                return got["result"]

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def open(self, url: str) -> None:
        self.send("Page.navigate", {"url": url}, session=True)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'", "the page loaded")

    def wait_for(self, condition: str, what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.evaluate(f"Boolean({condition})"):
            assert time.monotonic() < deadline, f"not {what} within {timeout_s:.0f} s"
            time.sleep(0.2)

    def screenshot(self, path: Path) -> None:
        import base64

        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"}, session=True)["data"]))

    def close(self) -> None:
        import os
        import signal
        import subprocess

        os.close(self._to_browser)  # Chromium ends when its command pipe closes
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        os.close(self._from_browser)
        self._profile.cleanup()
