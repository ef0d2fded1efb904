"""The service's database, behind this one module: jobs, their attempts and events, and users' token digests.

SQLAlchemy 2 typed mappings; any SQLAlchemy URL (``sqlite:///state/jobs.db`` by default, ``postgresql://...``).
The tables are created when missing; a change of schema will need a migration (Alembic), which is not built yet:
the schema version is stored so that a later release can tell an old database apart.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from sqlalchemy import Boolean, Float, ForeignKey, Integer, String, Text, create_engine, event, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

SCHEMA_VERSION = 1

# A job's states. held: admitted, waits for release; queued: waits for slots; running: its process runs;
# then one of the terminal states.
TERMINAL = ("succeeded", "failed", "cancelled")
STATES = ("held", "queued", "running", *TERMINAL)


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    user: Mapped[str] = mapped_column(String(200), index=True)
    name: Mapped[str] = mapped_column(String(200))
    state: Mapped[str] = mapped_column(String(20), index=True)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    slots: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)
    queued_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    finished_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    not_before: Mapped[float] = mapped_column(Float, default=0.0)  # retry backoff: not started before this time
    retries: Mapped[int] = mapped_column(Integer, default=0)  # restarts after a worker died
    recipe_yaml: Mapped[str] = mapped_column(Text)  # the recipe as submitted
    overrides_json: Mapped[str] = mapped_column(Text)  # KEY=VALUE list: the user's, then the chosen variant's
    variant: Mapped[Optional[str]] = mapped_column(Text, nullable=True)  # `auto`'s choice, as the planner names it
    plan_json: Mapped[str] = mapped_column(Text)  # the plan the job was admitted by
    planned_gpu_hours: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    total_steps: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    run_dir: Mapped[str] = mapped_column(Text)
    handle: Mapped[Optional[str]] = mapped_column(String(200), nullable=True)  # the backend's id of the process
    slot_ids_json: Mapped[str] = mapped_column(Text, default="[]")
    exit_code: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    error: Mapped[Optional[str]] = mapped_column(Text, nullable=True)

    @property
    def overrides(self) -> list[str]:
        return json.loads(self.overrides_json)

    @property
    def plan(self) -> dict:
        return json.loads(self.plan_json)

    @property
    def slot_ids(self) -> list[int]:
        return json.loads(self.slot_ids_json or "[]")


class Attempt(Base):
    """One start of a job's process: the first run and every retry."""

    __tablename__ = "attempts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    handle: Mapped[Optional[str]] = mapped_column(String(200), nullable=True)
    slot_ids_json: Mapped[str] = mapped_column(Text, default="[]")
    exit_code: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    resumed_from: Mapped[Optional[str]] = mapped_column(Text, nullable=True)  # checkpoint name, when one existed


class Event(Base):
    """What the service did with a job (queued, started, died, retried, cancelled...), for its events list."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    at: Mapped[float] = mapped_column(Float)
    level: Mapped[str] = mapped_column(String(10))
    message: Mapped[str] = mapped_column(Text)
    step: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)  # a training step's metrics, when one
    data_json: Mapped[Optional[str]] = mapped_column(Text, nullable=True)


class Token(Base):
    __tablename__ = "tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    user: Mapped[str] = mapped_column(String(200), index=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 of the token; the token is never stored
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[float] = mapped_column(Float)


class Meta(Base):
    __tablename__ = "meta"

    key: Mapped[str] = mapped_column(String(50), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Store:
    """The database at ``url``; tables created when missing. Thread-safe: one short session per call, and
    writes from this process one at a time (SQLite allows one writer)."""

    def __init__(self, url: str):
        sqlite = url.startswith("sqlite")
        self.engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30} if sqlite else {})
        if sqlite:
            event.listen(self.engine, "connect", _sqlite_wal)
        Base.metadata.create_all(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._write = threading.RLock()
        with self.session() as s:
            if s.get(Meta, "schema_version") is None:
                s.add(Meta(key="schema_version", value=str(SCHEMA_VERSION)))

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self._write, self._sessions() as s, s.begin():
            yield s

    def close(self) -> None:
        self.engine.dispose()

    # -- jobs --
    def add_job(self, job: Job) -> Job:
        with self.session() as s:
            s.add(job)
        return job

    def job(self, job_id: str) -> Optional[Job]:
        with self.session() as s:
            return s.get(Job, job_id)

    def jobs(self, user: Optional[str] = None, states: Optional[tuple[str, ...]] = None) -> list[Job]:
        q = select(Job).order_by(Job.created_at, Job.id)
        if user is not None:
            q = q.where(Job.user == user)
        if states is not None:
            q = q.where(Job.state.in_(states))
        with self.session() as s:
            return list(s.scalars(q))

    def update_job(self, job_id: str, **fields: Any) -> Job:
        with self.session() as s:
            job = s.get(Job, job_id)
            for k, v in fields.items():
                setattr(job, k, v)
            return job

    # -- attempts and events --
    def add_attempt(self, attempt: Attempt) -> None:
        with self.session() as s:
            s.add(attempt)

    def end_attempt(self, job_id: str, exit_code: Optional[int]) -> None:
        """Close the job's open attempt (the newest one without an end)."""
        with self.session() as s:
            q = select(Attempt).where(Attempt.job_id == job_id, Attempt.ended_at.is_(None))
            for a in s.scalars(q):
                a.ended_at, a.exit_code = time.time(), exit_code

    def attempts(self, job_id: Optional[str] = None) -> list[Attempt]:
        q = select(Attempt).order_by(Attempt.started_at, Attempt.id)
        if job_id is not None:
            q = q.where(Attempt.job_id == job_id)
        with self.session() as s:
            return list(s.scalars(q))

    def add_event(self, job_id: str, message: str, level: str = "info", step: Optional[int] = None,
                  data: Optional[dict] = None) -> None:  # fmt: skip
        with self.session() as s:
            s.add(Event(job_id=job_id, at=time.time(), level=level, message=message, step=step,
                        data_json=json.dumps(data) if data is not None else None))  # fmt: skip

    def events(self, job_id: str, after: int = 0) -> list[Event]:
        q = select(Event).where(Event.job_id == job_id, Event.id > after).order_by(Event.id)
        with self.session() as s:
            return list(s.scalars(q))

    def last_logged_step(self, job_id: str) -> int:
        with self.session() as s:
            q = select(Event.step).where(Event.job_id == job_id, Event.step.is_not(None)).order_by(Event.id.desc())
            return s.scalars(q).first() or 0

    # -- tokens --
    def add_token(self, user: str, digest: str, admin: bool = False) -> None:
        with self.session() as s:
            s.add(Token(user=user, digest=digest, admin=admin, created_at=time.time()))

    def token(self, digest: str) -> Optional[Token]:
        with self.session() as s:
            return s.scalars(select(Token).where(Token.digest == digest)).first()


def _sqlite_wal(dbapi_connection, _record) -> None:
    # WAL: readers (GET /v1/jobs) do not wait for the scheduler's writes, nor it for them.
    cur = dbapi_connection.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.close()
