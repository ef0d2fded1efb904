"""The service's core: a job's life from submission to its end, with no HTTP in it.

submit → admission (plan) → held or queued → the scheduler's tick starts it when the policy says (policy.py) →
running: its metrics become events, its end is read from its exit code and summary.json → succeeded, failed,
or, when its worker died, queued again to resume from its newest checkpoint (bounded retries, doubling backoff).
A restarted service takes back the processes that still run and requeues the jobs whose process is gone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from bigtune.engine.tracking.base import SERVE_JOB_ENV
from bigtune.recipe import parse_override
from bigtune.serve import progress
from bigtune.serve.admission import Admitted, Cluster, Rules, admit, admit_to_partition
from bigtune.serve.auth import new_token, token_digest
from bigtune.serve.backends import BackendError, LocalBackend, Work
from bigtune.serve.policy import AGING_S, Waiting, schedule
from bigtune.serve.store import TERMINAL, Attempt, Job, Store

# `bigtune train` exit codes (cli/app.py) that end a job for good: bad input and out of memory do not get better
# by retrying. Any other end (a signal, a crash, SIGTERM's 143) is a worker that died: retried from a checkpoint.
EXIT_OK, EXIT_BAD_INPUT, EXIT_OOM = 0, 2, 3
# Variables the jobs' processes do not inherit from the server: its tokens are not theirs.
PRIVATE_ENV = ("BIGTUNE_TOKEN", "BIGTUNE_ADMIN_TOKEN", "BIGTUNE_ADMIN_TOKENS")
# MLflow's own settings for reaching a server that wants a login: passed on to the jobs (a Ray job gets only
# what the service names), so that credentials need not sit in the tracking URI, where views and logs show it.
MLFLOW_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
              "MLFLOW_TRACKING_INSECURE_TLS", "MLFLOW_TRACKING_SERVER_CERT_PATH")  # fmt: skip


class NotFound(Exception):
    pass


class Forbidden(Exception):
    pass


class Conflict(Exception):
    pass


@dataclass(frozen=True)
class Caller:
    user: str
    admin: bool = False


@dataclass
class ServeConfig:
    """Everything ``bigtune serve`` is told. ``workdir``: the folder jobs run in and relative recipe paths count
    from."""

    state_dir: Path
    db_url: Optional[str] = None  # default: sqlite:///<state_dir>/jobs.db
    slots: int = 1
    cluster: Cluster = field(default_factory=Cluster)
    # Where jobs run: "local" (slots and cluster as given), "slurm" or "ray" (slots and cluster read from the
    # engine; cluster.gpu and cluster.host_ram_gib, where given, name the card and the RAM instead).
    backend: str = "local"
    partition: Optional[str] = None  # slurm: default Slurm's default partition
    # slurm: a cluster profile (the file `bigtune plan --cluster` reads): each job planned on every partition of
    # it and sent to the one the plan chooses, slots counted per partition
    cluster_profile: Optional[str] = None
    slurm_time: Optional[str] = None  # slurm: each job's --time (default: its plan's estimate x 1.5 + 15 min)
    ray_address: Optional[str] = None  # ray: the dashboard's address, http://HEAD:8265
    allowed_roots: tuple[Path, ...] = ()
    allow_trust_remote_code: bool = False
    admin_tokens: tuple[str, ...] = ()  # the raw tokens, from the environment; kept here as digests only
    quotas: dict[str, float] = field(default_factory=dict)  # user → GPU-hours
    aging_s: float = AGING_S
    max_retries: int = 3
    retry_backoff_s: float = 5.0  # doubled after each retry
    checkpoint_every_steps: int = 100  # for recipes that set no checkpoint.every_steps: what a retry resumes from
    # Every job an MLflow run on this tracking server (its URI as `bigtune train` takes it), in the recipe's
    # tracking.experiment, else this one. None: a job is tracked only where its recipe asks.
    mlflow_uri: Optional[str] = None
    mlflow_experiment: str = "bigtune-serve"
    cancel_grace_s: float = 5.0
    tick_s: float = 0.5
    python: str = sys.executable
    workdir: Path = field(default_factory=Path.cwd)

    @property
    def url(self) -> str:
        return self.db_url or f"sqlite:///{Path(self.state_dir).resolve() / 'jobs.db'}"


def make_backend(cfg: ServeConfig):
    """The backend ``cfg.backend`` names; a cluster's engine that cannot be reached raises BackendError."""
    if cfg.cluster_profile and cfg.backend != "slurm":
        raise BackendError(f"--cluster {cfg.cluster_profile}: a cluster profile names Slurm partitions; use it with "
                           "--backend slurm")  # fmt: skip
    if cfg.backend == "local":
        return LocalBackend(cfg.slots, gpus=cfg.cluster.gpu is not None)
    if cfg.backend == "slurm":
        from bigtune.serve.slurm_backend import SlurmBackend

        return SlurmBackend(cfg.partition, cfg.cluster.gpu, cfg.cluster.host_ram_gib, cfg.slurm_time,
                            cfg.cluster_profile)  # fmt: skip
    if cfg.backend == "ray":
        if not cfg.ray_address:
            raise BackendError("--backend ray needs the cluster's address: --ray-address http://HEAD:8265")
        from bigtune.serve.ray_backend import RayBackend

        return RayBackend(cfg.ray_address, cfg.cluster.gpu, cfg.cluster.host_ram_gib)
    raise BackendError(f"no backend {cfg.backend!r}: local, slurm or ray")


class Service:
    def __init__(self, cfg: ServeConfig, backend=None):
        self.backend = backend if backend is not None else make_backend(cfg)
        if cfg.backend != "local":  # admission plans against the GPUs the engine reports
            cfg = dataclasses.replace(cfg, cluster=self.backend.cluster, slots=self.backend.slots)
        self.cfg = cfg
        Path(cfg.state_dir).mkdir(parents=True, exist_ok=True)
        self.store = Store(cfg.url)
        self.rules = Rules(tuple(Path(r).resolve() for r in (cfg.allowed_roots or (cfg.workdir,))),
                           cfg.allow_trust_remote_code)  # fmt: skip
        self._admin_digests = tuple(token_digest(t) for t in cfg.admin_tokens)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._waiting: dict[str, tuple[int, str]] = {}  # job id → (queue position, why it waits)
        self._steps_logged: dict[str, int] = {}

    # -- who is calling --
    def caller(self, token: Optional[str]) -> Optional[Caller]:
        """The user a bearer token belongs to, or None."""
        if not token:
            return None
        digest = token_digest(token)
        import hmac

        if any(hmac.compare_digest(digest, d) for d in self._admin_digests):
            return Caller("admin", admin=True)
        row = self.store.token(digest)
        if row is None or not hmac.compare_digest(row.digest, digest):
            return None
        return Caller(row.user, admin=row.admin)

    def add_token(self, user: str, admin: bool = False) -> str:
        """A new token for ``user``, returned once; the database keeps its digest."""
        token = new_token()
        self.store.add_token(user, token_digest(token), admin)
        return token

    # -- jobs --
    def submit(self, caller: Caller, recipe, overrides: list[str], auto: bool = False, priority: int = 0,
               hold: bool = False) -> Job:  # fmt: skip
        """Admit (admission.py raises Refused) and queue a job; returns it."""
        offers, base = getattr(self.backend, "offers", None), Path(self.cfg.workdir)
        if offers is not None:  # a cluster profile: the plan chooses the partition
            adm: Admitted = admit_to_partition(recipe, list(overrides), auto, offers, self.rules, base)
        else:
            adm = admit(recipe, list(overrides), auto, self.cfg.cluster, self.rules, base)
        now = time.time()
        job_id = f"job-{int(now * 1000):x}-{secrets.token_hex(3)}"
        job_dir = Path(self.cfg.state_dir).resolve() / "jobs" / job_id
        job_dir.mkdir(parents=True)
        (job_dir / "recipe.yaml").write_text(yaml.safe_dump(adm.tree, sort_keys=False))
        user_out = adm.output_dir
        run_dir = (Path(self.cfg.workdir) / user_out / job_id) if user_out else job_dir / "run"
        job = Job(id=job_id, user=caller.user, name=adm.name, state="held" if hold else "queued", priority=priority,
                  slots=adm.slots, created_at=now, queued_at=now, recipe_yaml=yaml.safe_dump(adm.tree, sort_keys=False),
                  overrides_json=json.dumps(adm.overrides), variant=adm.variant, plan_json=json.dumps(adm.plan),
                  planned_gpu_hours=adm.planned_gpu_hours, total_steps=adm.total_steps,
                  run_dir=str(run_dir.resolve()))  # fmt: skip
        self.store.add_job(job)
        said = f" as the variant {adm.variant!r}" if adm.variant else ""
        where = f" of partition {adm.placement['partition']} ({adm.placement['why']})" if adm.placement else ""
        self.store.add_event(job_id, f"admitted{said} by its plan on {adm.plan.get('target')}; "
                                     f"{'held' if hold else 'queued'} for {adm.slots} slot(s){where}")  # fmt: skip
        return job

    def job(self, caller: Caller, job_id: str) -> Job:
        job = self.store.job(job_id)
        if job is None:
            raise NotFound(f"no job {job_id}")
        if not caller.admin and job.user != caller.user:
            raise Forbidden(f"job {job_id} belongs to another user")
        return job

    def jobs(self, caller: Caller) -> list[Job]:
        return self.store.jobs(user=None if caller.admin else caller.user)

    def view(self, job: Job, detail: bool = False) -> dict:
        """A job as the API shows it: state, queue position, progress, ETA, planned beside measured memory."""
        plan = job.plan
        pos, why = self._waiting.get(job.id, (None, None)) if job.state == "queued" else (None, None)
        if job.state == "held":
            why = "held: POST /v1/jobs/{id}/release to queue it"
        state = self.shown_state(job)
        if state == "pending":
            why = self.backend.queued_reason(job.handle)
        attempts = [{"number": a.number, "started_at": a.started_at, "ended_at": a.ended_at,
                     "exit_code": a.exit_code, "slot_ids": json.loads(a.slot_ids_json), "resumed_from": a.resumed_from,
                     "backend_job_id": a.handle}
                    for a in self.store.attempts(job.id)]  # fmt: skip
        out = {
            "id": job.id, "user": job.user, "name": job.name, "state": state, "priority": job.priority,
            "slots": job.slots, "slot_ids": job.slot_ids if job.state == "running" else [],
            "partition": (plan.get("partition") or {}).get("partition"),
            "created_at": job.created_at, "started_at": job.started_at, "finished_at": job.finished_at,
            "queue_position": pos, "waiting_because": why, "retries": job.retries, "attempts": attempts,
            "backend": self.backend.name, "backend_job_id": attempts[-1]["backend_job_id"] if attempts else None,
            "progress": progress.progress(job.run_dir, job.total_steps),
            "memory": {
                "planned_peak_allocated_bytes": plan.get("peak_allocated"),
                "planned_needed_bytes": plan.get("needed_total") or plan.get("peak_total"),
                "capacity_bytes": plan.get("capacity"),
                "measured_peak_allocated_bytes": progress.measured_peak_bytes(job.run_dir),
            },
            "variant": job.variant, "overrides": job.overrides, "planned_gpu_hours": job.planned_gpu_hours,
            "run_dir": job.run_dir, "error": job.error, "mlflow": progress.mlflow_run(job.run_dir),
        }  # fmt: skip
        if detail:
            out["plan"], out["recipe"] = plan, job.recipe_yaml
        return out

    def shown_state(self, job: Job) -> str:
        """The state the API shows: the stored one, except ``pending`` for a job the service has started (it holds
        its slots) that its engine still has in its own queue (Slurm's or Ray's PENDING, as at the last tick)."""
        if job.state == "running" and job.handle and self.backend.queued_reason(job.handle):
            return "pending"
        return job.state

    def release(self, caller: Caller, job_id: str) -> Job:
        with self._lock:
            job = self.job(caller, job_id)
            if job.state != "held":
                raise Conflict(f"job {job_id} is {job.state}, not held")
            self.store.add_event(job_id, "released: queued")
            return self.store.update_job(job_id, state="queued", queued_at=time.time())

    def cancel(self, caller: Caller, job_id: str) -> Job:
        """End a job: a waiting one at once; a running one's whole process group is stopped (SIGTERM, then SIGKILL
        after the grace period) and its slots are freed when it has ended."""
        with self._lock:
            job = self.job(caller, job_id)
            if job.state in TERMINAL:
                raise Conflict(f"job {job_id} has already ended: {job.state}")
            if job.state == "running" and job.handle:
                self.backend.cancel(job.handle, self.cfg.cancel_grace_s)
            self.store.add_event(job_id, f"cancelled by {caller.user}", level="warning")
            return self.store.update_job(job_id, state="cancelled", finished_at=time.time())

    def events(self, caller: Caller, job_id: str, after: int = 0) -> tuple[Job, list]:
        job = self.job(caller, job_id)
        return job, self.store.events(job_id, after)

    def output(self, caller: Caller, job_id: str, max_bytes: int = 65536) -> tuple[Job, str]:
        """The job's own output (bigtune train's log), every attempt's, its last ``max_bytes``: the local
        worker.log, the Slurm output files, the Ray job logs."""
        job = self.job(caller, job_id)
        return job, self._output(job, max_bytes)

    def _output(self, job: Job, max_bytes: int) -> str:
        handles = [a.handle for a in self.store.attempts(job.id) if a.handle]
        job_dir = Path(self.cfg.state_dir).resolve() / "jobs" / job.id
        try:
            return self.backend.output(handles, job_dir, Path(job.run_dir), max_bytes)
        except BackendError as e:
            return f"(its output cannot be read: {e})"

    def metrics(self, caller: Caller, job_id: str, max_points: int = 1000) -> dict:
        """The job's plots' data (progress.series) beside the memory its plan predicted."""
        job = self.job(caller, job_id)
        plan = job.plan
        return {"job_state": self.shown_state(job), **progress.series(job.run_dir, max_points),
                "planned_peak_allocated_bytes": plan.get("peak_allocated"), "capacity_bytes": plan.get("capacity")}  # fmt: skip

    def checkpoints(self, caller: Caller, job_id: str) -> list[dict]:
        return progress.checkpoints(self.job(caller, job_id).run_dir)

    # -- the scheduler --
    def start(self) -> None:
        """Take back what an earlier server left running, then tick in a thread until stop()."""
        self.recover()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="bigtune-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop scheduling. Running jobs go on: a restarted server takes them back."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.store.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - one bad tick must not stop the queue; said in the server's log
                print(f"bigtune serve: scheduler tick failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            self._stop.wait(self.cfg.tick_s)

    def tick(self) -> None:
        """One round: note the running jobs' new steps and ends, then start what the policy says."""
        with self._lock:
            now = time.time()
            for job in self.store.jobs(states=("running", "cancelled")):
                if job.handle is None:  # a cancelled job whose processes have ended
                    continue
                if job.state == "running":
                    self._log_new_steps(job)
                running, code = self.backend.poll(job.handle)
                if not running:
                    self._ended(job, code)
            queued = self.store.jobs(states=("queued",))
            waiting = [Waiting(j.id, j.user, j.priority, j.slots, j.queued_at, j.not_before, j.planned_gpu_hours,
                               (j.plan.get("partition") or {}).get("partition", "")) for j in queued]  # fmt: skip
            decision = schedule(waiting, self.backend.free_slots(), self._used_gpu_hours(now), self.cfg.quotas, now,
                                self.cfg.aging_s)  # fmt: skip
            self._waiting = {i: (n + 1, decision.blocked.get(i, "starting")) for n, i in enumerate(decision.order)}
            by_id = {j.id: j for j in queued}
            for job_id in decision.start:
                self._start(by_id[job_id])

    def _used_gpu_hours(self, now: float) -> dict[str, float]:
        users = {j.id: j.user for j in self.store.jobs()}
        used: dict[str, float] = {}
        for a in self.store.attempts():
            hours = ((a.ended_at or now) - a.started_at) * len(json.loads(a.slot_ids_json)) / 3600
            used[users[a.job_id]] = used.get(users[a.job_id], 0.0) + hours
        return used

    def _work(self, job: Job, attempt: int) -> Work:
        """What the backend runs: ``bigtune train`` of the job's recipe with its overrides, its run folder and a
        checkpoint interval (what a retry resumes from, with --auto-resume)."""
        job_dir = Path(self.cfg.state_dir).resolve() / "jobs" / job.id
        sets = [*job.overrides, f"output_dir={job.run_dir}", "checkpoint.enabled=true"]
        tree = yaml.safe_load(job.recipe_yaml) or {}
        if not (tree.get("checkpoint") or {}).get("every_steps") and not any(
            s.startswith("checkpoint.every_steps=") for s in job.overrides
        ):
            sets.append(f"checkpoint.every_steps={self.cfg.checkpoint_every_steps}")
        sets += self._tracking_sets(job)
        extra_env = {SERVE_JOB_ENV: job.id}
        if self.cfg.mlflow_uri:
            extra_env.update({k: os.environ[k] for k in MLFLOW_ENV if k in os.environ})
        step_s = job.plan.get("step_time_s")
        return Work(job_id=job.id, attempt=attempt, recipe=job_dir / "recipe.yaml", sets=sets,
                    run_dir=Path(job.run_dir), slots=job.slots, cwd=Path(self.cfg.workdir), python=self.cfg.python,
                    job_dir=job_dir, env={k: v for k, v in os.environ.items() if k not in PRIVATE_ENV},
                    extra_env=extra_env,
                    planned_s=step_s * job.total_steps if step_s and job.total_steps else None,
                    cancel_grace_s=self.cfg.cancel_grace_s, placement=job.plan.get("partition"))  # fmt: skip

    def _tracking_sets(self, job: Job) -> list[str]:
        """With an MLflow server (``cfg.mlflow_uri``): the overrides that make the job an MLflow run there, beside
        the trackers its recipe names, in its own experiment or the service's. The service's URI wins over the
        recipe's: the team's server is where the job's page links to."""
        if not self.cfg.mlflow_uri:
            return []
        tracking = (yaml.safe_load(job.recipe_yaml) or {}).get("tracking") or {}
        backends, experiment = tracking.get("backends") or [], tracking.get("experiment")
        for text in job.overrides:
            key, value = parse_override(text)
            if key == "tracking.backends":
                backends = value or []
            elif key == "tracking.experiment":
                experiment = value
        backends = [backends] if isinstance(backends, str) else list(backends)
        sets = [f"tracking.backends={json.dumps([*backends, 'mlflow'] if 'mlflow' not in backends else backends)}",
                f"tracking.mlflow_uri={json.dumps(self.cfg.mlflow_uri)}"]  # fmt: skip
        if not experiment:
            sets.append(f"tracking.experiment={json.dumps(self.cfg.mlflow_experiment)}")
        return sets

    def _start(self, job: Job) -> None:
        resumed = progress.newest_checkpoint(job.run_dir)
        number = len(self.store.attempts(job.id)) + 1
        try:
            started = self.backend.start(self._work(job, number))
        except BackendError as e:  # the engine refused it (a bad partition, a limit): it would refuse it again
            self._fail(job, None, str(e))
            return
        now = time.time()
        self.store.add_attempt(Attempt(job_id=job.id, number=number, started_at=now, handle=started.handle,
                                       slot_ids_json=json.dumps(started.slot_ids), resumed_from=resumed))  # fmt: skip
        self.store.update_job(job.id, state="running", handle=started.handle,
                              slot_ids_json=json.dumps(started.slot_ids), started_at=job.started_at or now)  # fmt: skip
        self._steps_logged[job.id] = self.store.last_logged_step(job.id)
        where = f", resuming from {resumed}" if resumed else ""
        self.store.add_event(job.id, f"started (attempt {number}) {started.where}{where}")

    def _log_new_steps(self, job: Job) -> None:
        """The run's new metrics.jsonl lines as events (steps past the newest one logged)."""
        last = self._steps_logged.get(job.id)
        if last is None:
            last = self._steps_logged[job.id] = self.store.last_logged_step(job.id)
        total = f"/{job.total_steps}" if job.total_steps else ""
        for row in progress.metrics(job.run_dir):
            if row.get("step", 0) > last:
                loss = f"loss {row['loss']:.4f}" if row.get("loss") is not None else "no loss"
                tps = f", {row['tokens_per_s']:,.0f} tokens/s" if row.get("tokens_per_s") else ""
                self.store.add_event(job.id, f"step {row['step']}{total}: {loss}{tps}", step=row["step"], data=row)
                last = row["step"]
        self._steps_logged[job.id] = last

    def _ended(self, job: Job, code: Optional[int]) -> None:
        """The job's process has ended with ``code`` (None: unknown): succeeded, failed, or queued to resume."""
        self.backend.release(job.handle)
        self.store.end_attempt(job.id, code)
        self._log_new_steps(job)
        now = time.time()
        if job.state == "cancelled":
            self.store.update_job(job.id, handle=None)
            self.store.add_event(job.id, f"its processes have ended (exit code {code}); slots freed")
            return
        done = progress.summary(job.run_dir) or {}
        status = done.get("status")
        if code == EXIT_OK or (code is None and status == "ok"):
            self.store.update_job(job.id, state="succeeded", finished_at=now, exit_code=code, handle=None)
            self.store.add_event(job.id, f"succeeded: {done.get('steps')} steps, final loss {done.get('final_loss')}")
            return
        if code in (EXIT_BAD_INPUT, EXIT_OOM) or status == "oom":
            why = "out of memory" if (code == EXIT_OOM or status == "oom") else "bad input"
            self._fail(job, code, f"{why} (exit code {code}): {self._log_tail(job)}")
            return
        if job.retries >= self.cfg.max_retries:
            self._fail(job, code, f"its worker died {job.retries + 1} times (last exit code {code}): "
                                  f"{self._log_tail(job)}")  # fmt: skip
            return
        backoff = self.cfg.retry_backoff_s * 2**job.retries
        ckpt = progress.newest_checkpoint(job.run_dir) or "the start (no checkpoint yet)"
        self.store.update_job(job.id, state="queued", retries=job.retries + 1, not_before=now + backoff, handle=None,
                              exit_code=code)  # fmt: skip
        self.store.add_event(job.id, f"worker died (exit code {code}); retry {job.retries + 1} of "
                                     f"{self.cfg.max_retries} in {backoff:.0f} s from {ckpt}", level="warning")  # fmt: skip

    def _fail(self, job: Job, code: Optional[int], error: str) -> None:
        self.store.update_job(job.id, state="failed", finished_at=time.time(), exit_code=code, handle=None,
                              error=error)  # fmt: skip
        self.store.add_event(job.id, f"failed: {error}", level="error")

    def _log_tail(self, job: Job, lines: int = 5) -> str:
        text = self._output(job, 16384).strip().splitlines()
        return " | ".join(text[-lines:]) or "(no output)"

    def recover(self) -> None:
        """At start: a running job whose process still runs is taken back; one whose process is gone is queued
        again to resume from its checkpoint (a server restart is not the job's fault: no retry is counted), or
        marked succeeded when its run had finished."""
        with self._lock:
            for job in self.store.jobs(states=("running",)):
                if job.handle and self.backend.adopt(job.handle, job.slot_ids, job.id):
                    self.store.add_event(job.id, "server restarted: its process still runs; taken back")
                    continue
                self.store.end_attempt(job.id, None)
                done = progress.summary(job.run_dir) or {}
                if done.get("status") == "ok":
                    self.store.update_job(job.id, state="succeeded", finished_at=time.time(), handle=None)
                    self.store.add_event(job.id, "server restarted: its run had finished")
                    continue
                ckpt = progress.newest_checkpoint(job.run_dir) or "the start (no checkpoint yet)"
                self.store.update_job(job.id, state="queued", handle=None)
                self.store.add_event(job.id, f"server restarted: its process is gone; queued to resume from {ckpt}",
                                     level="warning")  # fmt: skip
            for job in self.store.jobs(states=("cancelled",)):
                if job.handle:  # cancelled while the server was down: make sure nothing of it runs
                    self.backend.release(job.handle)
                    self.store.update_job(job.id, handle=None)
