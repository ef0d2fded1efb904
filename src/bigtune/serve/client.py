"""A client of the training service's API (what ``bigtune submit / jobs / logs / cancel`` call). Light: httpx and
the API's own models, no torch."""

from __future__ import annotations

import os
from typing import Any, Iterator, Optional

import httpx

from bigtune.serve.schemas import EventList, JobCreate, JobList, JobOutput, JobView

DEFAULT_SERVER = "http://127.0.0.1:8000"
TERMINAL = ("succeeded", "failed", "cancelled")


class ClientError(Exception):
    """A request the service refused or could not be sent; ``detail``: the service's refusal, when it sent one."""

    def __init__(self, message: str, status: Optional[int] = None, detail: Optional[dict] = None):
        super().__init__(message)
        self.status = status
        self.detail = detail or {}


class Client:
    """The API at ``server`` (default: $BIGTUNE_SERVER, else http://127.0.0.1:8000) with ``token`` (default:
    $BIGTUNE_TOKEN)."""

    def __init__(self, server: Optional[str] = None, token: Optional[str] = None, timeout_s: float = 300.0):
        self.server = (server or os.environ.get("BIGTUNE_SERVER") or DEFAULT_SERVER).rstrip("/")
        token = token or os.environ.get("BIGTUNE_TOKEN")
        if not token:
            raise ClientError("no token: give --token TOKEN or set BIGTUNE_TOKEN (an admin makes one with "
                              "`bigtune serve token add USER`)")  # fmt: skip
        # timeout: admission plans the recipe, which takes seconds (minutes for a large model's alternatives)
        self._http = httpx.Client(base_url=self.server, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)

    def _call(self, method: str, path: str, **kw: Any) -> dict:
        try:
            res = self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise ClientError(f"cannot reach the service at {self.server}: {e}") from None
        if res.status_code >= 400:
            try:
                detail = res.json().get("detail")
            except ValueError:
                detail = None
            if isinstance(detail, dict):
                reason = detail.get("reason") or str(detail)
            elif isinstance(detail, list):  # FastAPI's own validation of the request's shape
                reason = "; ".join(f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg')}" for d in detail)
                detail = {"reason": reason}
            else:
                reason = res.text.strip() or res.reason_phrase
            raise ClientError(f"{res.status_code}: {reason}", res.status_code, detail)
        return res.json()

    def submit(self, request: JobCreate) -> JobView:
        return JobView.model_validate(self._call("POST", "/v1/jobs", json=request.model_dump()))

    def jobs(self) -> JobList:
        return JobList.model_validate(self._call("GET", "/v1/jobs"))

    def job(self, job_id: str) -> JobView:
        return JobView.model_validate(self._call("GET", f"/v1/jobs/{job_id}"))

    def events(self, job_id: str, after: int = 0) -> EventList:
        return EventList.model_validate(self._call("GET", f"/v1/jobs/{job_id}/events", params={"after": after}))

    def output(self, job_id: str, max_bytes: int = 65536) -> JobOutput:
        return JobOutput.model_validate(self._call("GET", f"/v1/jobs/{job_id}/logs", params={"max_bytes": max_bytes}))

    def cancel(self, job_id: str) -> JobView:
        return JobView.model_validate(self._call("POST", f"/v1/jobs/{job_id}/cancel"))

    def follow(self, job_id: str, poll_s: float = 1.0) -> Iterator[Any]:
        """Every event of the job, then each new one as it comes, until the job has ended."""
        import time

        after = 0
        while True:
            page = self.events(job_id, after)
            for e in page.data:
                after = e.id
                yield e
            if page.job_state in TERMINAL and not page.data:
                return
            if not page.data:
                time.sleep(poll_s)
