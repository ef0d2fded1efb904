"""The service over HTTP: the API (api.py) under uvicorn, beside the scheduler's thread (service.py)."""

from __future__ import annotations

import threading
import time
from typing import Optional

import uvicorn

from bigtune.serve.api import create_app
from bigtune.serve.service import ServeConfig, Service


def _uvicorn(service: Service, host: str, port: int, log_level: str) -> uvicorn.Server:
    # uvicorn's access log names method, path and status only: the Authorization header never reaches a log
    config = uvicorn.Config(create_app(service), host=host, port=port, log_level=log_level, lifespan="off")
    return uvicorn.Server(config)


def serve_forever(service: Service, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """``bigtune serve`` of a made ``Service(cfg)``: until Ctrl-C or SIGTERM. Running jobs go on after it stops;
    the next start takes them back."""
    service.start()
    try:
        _uvicorn(service, host, port, log_level).run()
    finally:
        service.stop()


class InThread:
    """The service on ``host:port`` in a thread of this process (tests, notebooks): ``start()`` returns once it
    answers, ``stop()`` ends the server and the scheduler (jobs go on, as after ``serve_forever``)."""

    def __init__(self, cfg: ServeConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning"):
        self.cfg, self.host, self.port = cfg, host, port
        self.service: Optional[Service] = None
        self._server: Optional[uvicorn.Server] = None
        self._thread: Optional[threading.Thread] = None
        self._log_level = log_level

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "InThread":
        self.service = Service(self.cfg)
        self.service.start()
        self._server = _uvicorn(self.service, self.host, self.port, self._log_level)
        self._thread = threading.Thread(target=self._server.run, name="bigtune-serve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the service did not start on {self.url} within {timeout_s:.0f} s")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.service is not None:
            self.service.stop()
