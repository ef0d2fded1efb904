"""`bigtune export RUN --push REPO_ID`: huggingface_hub's own client against a local stand-in for the hub.

The hub cannot be reached from the test machines, so each test starts a small HTTP server on 127.0.0.1 that
answers the endpoints ``create_repo`` and ``upload_folder`` call (create the repo, check a model card's
metadata, ask each file's upload mode, commit), always asking for plain "regular" uploads so the files arrive inside the commit. The
CLI runs in its own process with HF_ENDPOINT pointing there, so the real client code, URLs and payloads
are exercised; what the stand-in received is compared with the exported folder byte for byte.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from bigtune.run.training import train
from conftest import HANG_GUARD_S, ROOT, tiny_overrides

REPO = "someone/tiny-lora"


class FakeHub:
    """The hub's repo-create, validate-yaml, preupload and commit endpoints, recording what they were sent."""

    def __init__(self, refuse_with: int | None = None):
        self.requests: list[tuple[str, str, dict]] = []  # (method, path, headers)
        self.created: list[dict] = []
        self.files: dict[str, bytes] = {}
        self.refuse_with = refuse_with
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the test output clean
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):  # noqa: N802 - the http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hub.requests.append(("POST", self.path, {k.lower(): v for k, v in self.headers.items()}))
                if hub.refuse_with:
                    self._reply(hub.refuse_with, {"error": "Invalid credentials in Authorization header"})
                elif self.path == "/api/repos/create":
                    req = json.loads(body)
                    hub.created.append(req)
                    name = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
                    self._reply(200, {"url": f"http://{self.headers['Host']}/{name}", "name": name, "id": "x"})
                elif self.path == "/api/validate-yaml":  # a README.md model card's metadata, checked first
                    self._reply(200, {"errors": [], "warnings": []})
                elif "/preupload/" in self.path:
                    paths = [f["path"] for f in json.loads(body)["files"]]
                    self._reply(
                        200, {"files": [{"path": p, "uploadMode": "regular", "shouldIgnore": False} for p in paths]}
                    )
                elif "/commit/" in self.path:
                    for line in body.splitlines():
                        item = json.loads(line)
                        if item["key"] == "file":
                            hub.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                        elif item["key"] != "header":
                            raise AssertionError(f"unexpected commit entry {item['key']}")
                    repo = self.path.split("/api/models/")[1].split("/commit/")[0]
                    url = f"http://{self.headers['Host']}/{repo}/commit/{'a' * 40}"
                    self._reply(200, {"commitUrl": url, "commitOid": "a" * 40, "pullRequestUrl": None})
                else:
                    self._reply(404, {"error": f"the stand-in does not serve POST {self.path}"})

            def do_GET(self):  # noqa: N802
                hub.requests.append(("GET", self.path, {k.lower(): v for k, v in self.headers.items()}))
                self._reply(404, {"error": f"the stand-in does not serve GET {self.path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.timeout = 5
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("push") / "run"
    s = train({}, tiny_overrides(run, **{"peft.method": "lora", "checkpoint.save_model": True, "train.max_steps": 1}))
    assert s["status"] == "ok" and (run / "adapter").is_dir()
    return run


def is_private(create_request: dict) -> bool:
    """huggingface_hub 1.x sends `private`, later versions `visibility`."""
    if "visibility" in create_request:
        return create_request["visibility"] == "private"
    return bool(create_request["private"])


def hub_env(tmp_path: Path, endpoint: str, token: str | None = "hf_test_token") -> dict:
    """The CLI's environment: this hub, this token, and a fresh HF_HOME (no login stored elsewhere is read)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1")
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def export(run: Path, tmp_path: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    env = {**env, "PYTHONPATH": str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "bigtune", "export", str(run), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )


def test_push_uploads_the_exported_adapter_folder(lora_run, tmp_path):
    with FakeHub() as hub:
        res = export(lora_run, tmp_path, hub_env(tmp_path, hub.url), "--push", REPO)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    folder = lora_run / "export-adapter"
    assert res.stdout.splitlines()[0] == str(folder)
    assert res.stdout.splitlines()[-1] == f"pushed to {hub.url}/{REPO}/commit/{'a' * 40}"
    # the repo was created (public by default) with the user's token, then the folder committed as it is
    assert [(c["organization"], c["name"], c["type"], is_private(c)) for c in hub.created] == [
        ("someone", "tiny-lora", "model", False)
    ]
    assert all(h.get("authorization") == "Bearer hf_test_token" for _, _, h in hub.requests)
    on_disk = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert "adapter_model.safetensors" in on_disk and "adapter_config.json" in on_disk
    assert hub.files == on_disk


def test_private_creates_a_private_repo(lora_run, tmp_path):
    with FakeHub() as hub:
        res = export(lora_run, tmp_path, hub_env(tmp_path, hub.url), "--push", REPO, "--private")
    assert res.returncode == 0, res.stderr[-2000:]
    assert [is_private(c) for c in hub.created] == [True]


def test_private_without_push_is_refused(lora_run, tmp_path):
    res = export(lora_run, tmp_path, hub_env(tmp_path, "http://127.0.0.1:9"), "--private")
    assert res.returncode == 2
    assert res.stderr.strip() == "bigtune: error: --private applies to --push REPO_ID only; add --push"


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_hub_is_one_clear_error(lora_run, tmp_path):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    res = export(lora_run, tmp_path, hub_env(tmp_path, endpoint), "--push", REPO)
    assert res.returncode == 2, res.stderr[-2000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("bigtune: error:")]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert errors[0].startswith(f"bigtune: error: --push {REPO}: could not reach the Hugging Face Hub at {endpoint} (")
    assert errors[0].endswith(
        f"check the network, a proxy or HF_ENDPOINT, or upload it later with `hf upload {REPO} "
        f"{lora_run / 'export-adapter'}`"
    )


def test_no_token_is_refused_before_contacting_the_hub(lora_run, tmp_path):
    with FakeHub() as hub:
        res = export(lora_run, tmp_path, hub_env(tmp_path, hub.url, token=None), "--push", REPO)
    assert res.returncode == 2
    assert res.stderr.strip() == (
        f"bigtune: error: --push {REPO}: no Hugging Face token; set HF_TOKEN to a token with write access or run "
        "`hf auth login`, then export again"
    )
    assert res.stdout == "" and hub.requests == []  # said before exporting anything


def test_a_bad_repo_id_is_refused_before_exporting(lora_run, tmp_path):
    with FakeHub() as hub:
        res = export(lora_run, tmp_path, hub_env(tmp_path, hub.url), "--push", "me/my lora")
    assert res.returncode == 2
    assert res.stderr.startswith("bigtune: error: --push 'me/my lora': not a Hub repository id (")
    assert res.stderr.strip().endswith("give owner/name, e.g. me/my-lora")
    assert res.stdout == "" and hub.requests == []


def test_a_refused_token_says_how_to_fix_it(lora_run, tmp_path):
    with FakeHub(refuse_with=401) as hub:
        res = export(lora_run, tmp_path, hub_env(tmp_path, hub.url), "--push", REPO)
    assert res.returncode == 2
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("bigtune: error:")]
    assert len(errors) == 1, res.stderr[-2000:]
    assert errors[0].startswith(f"bigtune: error: --push {REPO}: the hub at {hub.url} refused (")
    assert "use a token with write access to it (HF_TOKEN or `hf auth login`)" in errors[0]
