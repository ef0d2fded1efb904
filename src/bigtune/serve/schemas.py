"""The API's request and response models: one set for the routes, the OpenAPI schema and the CLI client."""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, Field


class JobCreate(BaseModel):
    """A fine-tuning job: a bigtune recipe (YAML text or a mapping) and ``KEY=VALUE`` overrides on top."""

    recipe: Union[str, dict[str, Any]] = Field(description="the recipe: YAML text or a mapping of its keys")
    overrides: list[str] = Field(default_factory=list, description="KEY=VALUE, as `bigtune train --set`")
    auto: bool = Field(False, description="if the recipe does not fit the cluster, run its fastest fitting variant")
    priority: int = Field(0, description="higher starts first; waiting raises it by one level per aging period")
    hold: bool = Field(False, description="admit and plan, but do not queue until POST /v1/jobs/{id}/release")


class Progress(BaseModel):
    step: int = 0
    total_steps: Optional[int] = None
    fraction: Optional[float] = None
    eta_s: Optional[float] = None
    loss: Optional[float] = None


class Memory(BaseModel):
    """Per device, bytes: what the admitting plan predicted beside what the run measured."""

    planned_peak_allocated_bytes: Optional[int] = None
    planned_needed_bytes: Optional[int] = Field(None, description="the plan's peak with allocator reserve and context")
    capacity_bytes: Optional[int] = None
    measured_peak_allocated_bytes: Optional[int] = None


class MlflowRun(BaseModel):
    """The job's MLflow run (every job's, when the service runs with --mlflow-uri), from its run folder."""

    run_id: str
    experiment: Optional[str] = None
    experiment_id: Optional[str] = None
    tracking_uri: Optional[str] = None
    url: Optional[str] = Field(None, description="the run's page in the MLflow UI (where the URI is a server's)")


class AttemptView(BaseModel):
    number: int
    started_at: float
    ended_at: Optional[float] = None
    exit_code: Optional[int] = None
    slot_ids: list[int] = Field(default_factory=list)
    resumed_from: Optional[str] = None
    backend_job_id: Optional[str] = Field(None, description="the process id, Slurm job id or Ray submission id")


class JobView(BaseModel):
    id: str
    object: str = "fine_tuning.job"
    user: str
    name: str
    state: str = Field(description="held, queued, pending, running, succeeded, failed or cancelled; pending: the "
                       "service has handed it to its engine (its slots are held), which has not started it yet "
                       "(Slurm's or Ray's PENDING; waiting_because gives the engine's reason)")  # fmt: skip
    priority: int
    slots: int
    slot_ids: list[int] = Field(default_factory=list)
    created_at: float
    started_at: Optional[float] = None
    finished_at: Optional[float] = None
    partition: Optional[str] = Field(None, description="slurm with a cluster profile: the partition its plan chose")
    queue_position: Optional[int] = None
    waiting_because: Optional[str] = None
    retries: int = 0
    attempts: list[AttemptView] = Field(default_factory=list)
    backend: str = Field("local", description="where it runs: local, slurm or ray")
    backend_job_id: Optional[str] = Field(None, description="its newest attempt's id in the backend: the process "
                                          "id, the Slurm job id, the Ray submission id")  # fmt: skip
    progress: Progress
    memory: Memory
    variant: Optional[str] = Field(None, description="the variant `auto` chose, when the recipe itself did not fit")
    overrides: list[str] = Field(default_factory=list)
    planned_gpu_hours: Optional[float] = None
    run_dir: str
    error: Optional[str] = None
    mlflow: Optional[MlflowRun] = Field(None, description="its MLflow run, once it has started one")
    plan: Optional[dict[str, Any]] = Field(None, description="the plan the job was admitted by (GET of one job)")
    recipe: Optional[str] = Field(None, description="the recipe as submitted (GET of one job)")


class JobList(BaseModel):
    object: str = "list"
    data: list[JobView]


class EventView(BaseModel):
    id: int
    object: str = "fine_tuning.job.event"
    created_at: float
    level: str
    message: str
    step: Optional[int] = None
    data: Optional[dict[str, Any]] = None


class EventList(BaseModel):
    object: str = "list"
    data: list[EventView]
    job_state: str


class JobOutput(BaseModel):
    """The job's own output (bigtune train's log), every attempt's: the local worker log, the Slurm output files,
    the Ray job logs."""

    object: str = "fine_tuning.job.output"
    job_state: str
    backend: str
    text: str


class StepPoint(BaseModel):
    step: int
    loss: Optional[float] = None
    tokens_per_s: Optional[float] = None
    step_time_s: Optional[float] = None


class MemoryPoint(BaseModel):
    """One memory snapshot (the run's memory.jsonl), bytes per device."""

    step: int
    phase: Optional[str] = None
    allocated: Optional[int] = None
    peak_allocated: Optional[int] = None
    reserved: Optional[int] = None
    peak_reserved: Optional[int] = None


class JobMetrics(BaseModel):
    """What the job's run has logged so far, for plots: each logged step, each memory snapshot (thinned to
    ``max_points`` each, the last kept), and the peak its plan predicted."""

    object: str = "fine_tuning.job.metrics"
    job_state: str
    steps: list[StepPoint]
    memory: list[MemoryPoint]
    planned_peak_allocated_bytes: Optional[int] = None
    capacity_bytes: Optional[int] = None


class CheckpointView(BaseModel):
    object: str = "fine_tuning.job.checkpoint"
    step: Optional[int]
    path: str
    bytes: int
    created_at: float


class CheckpointList(BaseModel):
    object: str = "list"
    data: list[CheckpointView]


class Refusal(BaseModel):
    """Why a request was refused: the reason, each problem on its own, and for a job that does not fit, its plan
    and the variants that would."""

    reason: str
    problems: list[str] = Field(default_factory=list)
    plan: Optional[dict[str, Any]] = None
    alternatives: list[dict[str, Any]] = Field(default_factory=list)
