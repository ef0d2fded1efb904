"""The REST API: routes parse the request and check who calls, then call the service (service.py).

Shaped like the fine-tuning job APIs people already use: create, list, get, events, logs, metrics, cancel,
checkpoints under /v1/jobs; the OpenAPI schema at /openapi.json and its pages at /docs; the web page at /
(page.py). Every route but /healthz and the page wants ``Authorization: Bearer <token>``: none or an unknown one
is 401; another user's job is 403.
"""

from typing import Annotated, Optional

from fastapi import Depends, FastAPI, Header, HTTPException, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse

from bigtune.serve.admission import Refused
from bigtune.serve.auth import bearer
from bigtune.serve.page import page
from bigtune.serve.schemas import (
    CheckpointList,
    EventList,
    JobCreate,
    JobList,
    JobMetrics,
    JobOutput,
    JobView,
    Refusal,
)
from bigtune.serve.service import Caller, Conflict, Forbidden, NotFound, Service

REFUSALS = {
    401: {"model": Refusal, "description": "no token, or not a token of this service"},
    403: {"model": Refusal, "description": "another user's job, or against the admin's rules"},
    404: {"model": Refusal, "description": "no such job"},
}


def job_or_error(call):
    """``call()``, with the service's refusals as HTTP errors: 404 no such job, 403 another user's, 409 a conflict."""
    try:
        return call()
    except NotFound as e:
        raise HTTPException(404, detail={"reason": str(e)}) from None
    except Forbidden as e:
        raise HTTPException(403, detail={"reason": str(e)}) from None
    except Conflict as e:
        raise HTTPException(409, detail={"reason": str(e)}) from None


def create_app(service: Service) -> FastAPI:
    """The FastAPI application over ``service``.

    Long because it is the list of routes, each a few lines that parse, authorise and call the service."""
    from bigtune import __version__

    app = FastAPI(
        title="bigtune training service",
        version=__version__,
        description="Fine-tuning jobs admitted by their memory plan, queued and run (docs/how-to/serve.md).",
    )

    def caller(authorization: Annotated[Optional[str], Header()] = None) -> Caller:
        who = service.caller(bearer(authorization))
        if who is None:
            raise HTTPException(401, detail={"reason": "no valid bearer token"}, headers={"WWW-Authenticate": "Bearer"})
        return who

    Who = Annotated[Caller, Depends(caller)]

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict:
        return {"ok": True}

    @app.get("/", include_in_schema=False, response_class=HTMLResponse)
    def web_page():
        # no token here: the page asks for it and sends it with each of its API requests
        html, headers = page()
        return HTMLResponse(html, headers=headers)

    @app.post(
        "/v1/jobs",
        response_model=JobView,
        status_code=201,
        responses={
            **REFUSALS,
            409: {"model": Refusal, "description": "can never fit this cluster: the plan's reason and what would fit"},
            422: {"model": Refusal, "description": "the recipe is not valid: each problem names its key"},
        },
    )
    async def create_job(body: JobCreate, who: Who):
        """Submit a job: its recipe is checked and planned against the cluster, then it is queued (or held)."""

        def submit():
            return service.submit(who, body.recipe, body.overrides, body.auto, body.priority, body.hold)

        try:
            # planning takes seconds of CPU: off the event loop, so other requests are answered meanwhile
            job = await run_in_threadpool(submit)
        except Refused as e:
            return JSONResponse(status_code=e.status, content={"detail": e.to_dict()})
        return service.view(job, detail=True)

    @app.get("/v1/jobs", response_model=JobList, responses=REFUSALS)
    def list_jobs(who: Who):
        """Your jobs, oldest first (an admin: everyone's)."""
        return {"data": [service.view(j) for j in service.jobs(who)]}

    @app.get("/v1/jobs/{job_id}", response_model=JobView, responses=REFUSALS)
    def get_job(job_id: str, who: Who):
        """One job: state, queue position, attempts, progress, planned and measured memory, plan and recipe."""
        return service.view(job_or_error(lambda: service.job(who, job_id)), detail=True)

    @app.get("/v1/jobs/{job_id}/events", response_model=EventList, responses=REFUSALS)
    def job_events(job_id: str, who: Who, after: Annotated[int, Query(ge=0)] = 0):
        """What the service did with the job and each logged step, newer than event ``after``."""
        job, events = job_or_error(lambda: service.events(who, job_id, after))
        import json

        data = [{"id": e.id, "created_at": e.at, "level": e.level, "message": e.message, "step": e.step,
                 "data": json.loads(e.data_json) if e.data_json else None} for e in events]  # fmt: skip
        return {"data": data, "job_state": service.shown_state(job)}

    @app.get("/v1/jobs/{job_id}/logs", response_model=JobOutput, responses=REFUSALS)
    def job_logs(job_id: str, who: Who, max_bytes: Annotated[int, Query(ge=1, le=2**24)] = 65536):
        """The job's own output (bigtune train's log), every attempt's: its last ``max_bytes``."""
        job, text = job_or_error(lambda: service.output(who, job_id, max_bytes))
        return {"job_state": service.shown_state(job), "backend": service.backend.name, "text": text}

    @app.get("/v1/jobs/{job_id}/metrics", response_model=JobMetrics, responses=REFUSALS)
    def job_metrics(job_id: str, who: Who, max_points: Annotated[int, Query(ge=2, le=100_000)] = 1000):
        """The logged steps and memory snapshots (at most ``max_points`` of each) and the planned peak."""
        return job_or_error(lambda: service.metrics(who, job_id, max_points))

    @app.post("/v1/jobs/{job_id}/cancel", response_model=JobView, responses={**REFUSALS, 409: {"model": Refusal}})
    def cancel_job(job_id: str, who: Who):
        """Stop the job: a waiting one at once, a running one's processes (SIGTERM, then SIGKILL)."""
        return service.view(job_or_error(lambda: service.cancel(who, job_id)))

    @app.post("/v1/jobs/{job_id}/release", response_model=JobView, responses={**REFUSALS, 409: {"model": Refusal}})
    def release_job(job_id: str, who: Who):
        """Queue a job that was submitted with ``hold``."""
        return service.view(job_or_error(lambda: service.release(who, job_id)))

    @app.get("/v1/jobs/{job_id}/checkpoints", response_model=CheckpointList, responses=REFUSALS)
    def job_checkpoints(job_id: str, who: Who):
        """The job's resumable checkpoints: step, path, size."""
        return {"data": job_or_error(lambda: service.checkpoints(who, job_id))}

    return app


def openapi_schema() -> dict:
    """The API's OpenAPI schema, as /openapi.json serves it, without a service (the docs' API reference)."""
    return create_app(None).openapi()  # the routes' service is only used when they are called
