"""cli.serve: ``bigtune serve`` (the training service), ``serve token add``, and its client verbs ``submit``,
``jobs``, ``logs`` and ``cancel``. Bad input (a refused job, a bad token, an unreachable server): one line on
stderr, exit 2."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_OK, EXIT_BAD_INPUT = 0, 2

SERVE_PACKAGES = ("fastapi", "uvicorn", "sqlalchemy", "httpx", "pydantic", "starlette")  # the 'serve' extra's
NO_SERVE = "the training service needs FastAPI, uvicorn, SQLAlchemy and httpx: pip install 'bigtune[serve]'"


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", help="the service's URL (default: $BIGTUNE_SERVER, else http://127.0.0.1:8000)")
    p.add_argument("--token", help="your API token (default: $BIGTUNE_TOKEN; better, as it stays out of `ps`)")


def _state_args(p: argparse.ArgumentParser, default) -> None:
    p.add_argument("--state", default=default, metavar="DIR",
                   help="the service's folder: its SQLite database, each job's recipe, log and run (default ./bigtune-serve)")  # fmt: skip
    p.add_argument("--db", default=default, metavar="URL",
                   help="any SQLAlchemy database URL instead of <state>/jobs.db, e.g. postgresql://host/bigtune")  # fmt: skip


def add_cli(sub) -> None:
    """Add ``serve``, ``submit``, ``jobs``, ``logs`` and ``cancel`` to bigtune's subparsers.

    Long because it is a declarative list of flags, one call each (as cli/app.py's build_parser)."""
    s = sub.add_parser("serve", help="run the training service: admits jobs by their plan, queues and runs them")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    _state_args(s, None)
    s.add_argument("--backend", choices=["local", "slurm", "ray"], default="local",
                   help="where jobs run: local = subprocesses on this machine's slots; slurm = sbatch jobs on the "
                   "cluster sinfo shows; ray = Ray jobs on --ray-address (their GPUs read from the engine)")  # fmt: skip
    s.add_argument("--partition", help="slurm: the partition jobs go to and whose GPUs admit them (default: "
                   "Slurm's default partition)")  # fmt: skip
    s.add_argument("--cluster", metavar="PROFILE", help="slurm: a cluster profile (as bigtune plan --cluster): each "
                   "job is planned on every partition it names and sent to the cheapest that fits; slots are "
                   "counted per partition (replaces --partition and --gpu)")  # fmt: skip
    s.add_argument("--slurm-time", metavar="TIME", help="slurm: each job's --time, e.g. 12:00:00 (default: its "
                   "plan's estimate x 1.5 + 15 min, else 24:00:00)")  # fmt: skip
    s.add_argument("--ray-address", metavar="URL",
                   help="ray: the dashboard's address (Ray's job API), e.g. http://head:8265")  # fmt: skip
    s.add_argument("--slots", type=int, default=1,
                   help="local: GPUs jobs may use at once (on a CPU machine slots stand in for GPUs; default 1)")  # fmt: skip
    s.add_argument("--gpu", metavar="KIND", help="the cluster's GPU, from the catalog (e.g. rtx-4090, h100-80gb): "
                   "jobs are planned against it; default: this machine's CPU (slurm, ray: the kind the engine "
                   "reports)")  # fmt: skip
    s.add_argument("--gpus-per-node", type=int, help="local: GPUs per node (default: --slots)")
    s.add_argument("--host-ram", type=float, metavar="GIB", help="host RAM per node: plans that need more are "
                   "refused (slurm, ray: default the nodes' memory)")  # fmt: skip
    s.add_argument("--allow-root", action="append", default=[], metavar="DIR",
                   help="a folder recipe paths (data, model folders, output_dir) may name (repeatable; default: "
                   "the folder the service starts in)")  # fmt: skip
    s.add_argument("--allow-trust-remote-code", action="store_true",
                   help="let recipes set model.trust_remote_code (code shipped with hub models runs in the jobs)")  # fmt: skip
    s.add_argument("--quota", action="append", default=[], metavar="USER=HOURS",
                   help="a user's GPU-hour quota (repeatable; default: none)")  # fmt: skip
    s.add_argument("--aging-minutes", type=float, default=10.0,
                   help="a waiting job gains one priority level per this many minutes (default 10)")  # fmt: skip
    s.add_argument("--max-retries", type=int, default=3, help="restarts of a job whose worker died (default 3)")
    s.add_argument("--retry-backoff", type=float, default=5.0, metavar="S",
                   help="seconds before the first restart, doubled for each next one (default 5)")  # fmt: skip
    s.add_argument("--checkpoint-every", type=int, default=100, metavar="STEPS",
                   help="checkpoint interval for recipes that set none: what a restarted job resumes from")  # fmt: skip
    s.add_argument("--mlflow-uri", metavar="URL", help="every job an MLflow run on this tracking server (e.g. "
                   "http://mlflow:5000), linked from its view and the service's page (default: only where a recipe "
                   "asks for tracking)")  # fmt: skip
    s.add_argument("--mlflow-experiment", default="bigtune-serve", metavar="NAME",
                   help="the MLflow experiment of jobs whose recipe names none (default bigtune-serve)")  # fmt: skip
    tokens = s.add_subparsers(dest="serve_verb", metavar="token")
    t = tokens.add_parser("token", help="make an API token for a user (printed once; stored hashed)")
    t.add_argument("action", choices=["add"])
    t.add_argument("user")
    t.add_argument("--admin", action="store_true", help="the token may see and cancel every user's jobs")
    _state_args(t, argparse.SUPPRESS)
    s.set_defaults(func=main_serve)

    p = sub.add_parser("submit", help="send a recipe to the training service as a job")
    p.add_argument("recipe", help="recipe YAML (read here, sent as text; its paths are read on the service's side)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--auto", action="store_true", help="if it does not fit the cluster, run its fastest fitting variant"
    )
    p.add_argument("--priority", type=int, default=0, help="higher starts first (default 0)")
    p.add_argument("--hold", action="store_true", help="admit and plan it, but do not queue it yet")
    _client_args(p)
    p.set_defaults(func=main_client)
    j = sub.add_parser("jobs", help="your jobs on the training service (an admin: everyone's)")
    _client_args(j)
    j.set_defaults(func=main_client)
    lg = sub.add_parser("logs", help="a job's events: state changes and each logged step")
    lg.add_argument("job")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new events until the job ends")
    lg.add_argument("--output", action="store_true", help="the job's own output instead (bigtune train's log: the "
                    "worker log, the Slurm output file, the Ray job logs)")  # fmt: skip
    _client_args(lg)
    lg.set_defaults(func=main_client)
    c = sub.add_parser("cancel", help="cancel a job (a running one's processes are stopped)")
    c.add_argument("job")
    _client_args(c)
    c.set_defaults(func=main_client)


def _error(message: str) -> int:
    print(f"bigtune: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _config(args):
    from bigtune.serve.admission import Cluster
    from bigtune.serve.service import ServeConfig

    state = Path(args.state or "bigtune-serve")
    quotas = {}
    for q in getattr(args, "quota", []):
        user, _, hours = q.partition("=")
        try:
            quotas[user.strip()] = float(hours)
        except ValueError:
            raise ValueError(f"--quota {q}: expected USER=HOURS, e.g. --quota alice=100") from None
    tokens = tuple(t.strip() for t in os.environ.get("BIGTUNE_ADMIN_TOKENS", "").split(",") if t.strip())
    cluster = Cluster(getattr(args, "gpu", None), getattr(args, "gpus_per_node", None) or getattr(args, "slots", 1), 1,
                      getattr(args, "host_ram", None))  # fmt: skip
    return ServeConfig(
        state_dir=state, db_url=args.db, slots=getattr(args, "slots", 1), cluster=cluster,
        allowed_roots=tuple(Path(r) for r in getattr(args, "allow_root", [])),
        allow_trust_remote_code=getattr(args, "allow_trust_remote_code", False), admin_tokens=tokens, quotas=quotas,
        aging_s=60 * getattr(args, "aging_minutes", 10.0), max_retries=getattr(args, "max_retries", 3),
        retry_backoff_s=getattr(args, "retry_backoff", 5.0),
        checkpoint_every_steps=getattr(args, "checkpoint_every", 100), backend=getattr(args, "backend", "local"),
        partition=getattr(args, "partition", None), slurm_time=getattr(args, "slurm_time", None),
        cluster_profile=getattr(args, "cluster", None),
        ray_address=getattr(args, "ray_address", None), mlflow_uri=getattr(args, "mlflow_uri", None),
        mlflow_experiment=getattr(args, "mlflow_experiment", "bigtune-serve"),
    )  # fmt: skip


def main_serve(args) -> int:
    try:
        import fastapi  # noqa: F401
        import sqlalchemy  # noqa: F401
        import uvicorn  # noqa: F401
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in SERVE_PACKAGES:
            raise
        return _error(NO_SERVE)
    try:
        cfg = _config(args)
    except ValueError as e:
        return _error(str(e))
    if args.serve_verb == "token":
        import dataclasses

        from bigtune.serve.service import Service

        service = Service(dataclasses.replace(cfg, backend="local"))  # the database only: no cluster asked
        token = service.add_token(args.user, admin=args.admin)
        service.store.close()
        print(token)
        print(f"the token of {args.user}{' (admin)' if args.admin else ''}: shown once, stored hashed", file=sys.stderr)
        return EXIT_OK
    if cfg.slots < 1:
        return _error("--slots must be at least 1")
    if cfg.cluster.gpu:
        from bigtune.core.gpus import UnknownGPUError, find_gpu

        try:
            find_gpu(cfg.cluster.gpu)
        except UnknownGPUError as e:
            return _error(str(e))
    if cfg.mlflow_uri:
        import importlib.util

        if importlib.util.find_spec("mlflow") is None:  # the jobs run this Python: they would each fail
            return _error(
                "--mlflow-uri: MLflow is not installed: pip install 'bigtune[mlflow]', or leave --mlflow-uri out"
            )
    from bigtune.serve.backends import BackendError
    from bigtune.serve.server import serve_forever
    from bigtune.serve.service import Service

    try:
        service = Service(cfg)
    except BackendError as e:
        return _error(str(e))
    from bigtune.serve.progress import without_login

    c = service.cfg.cluster
    print(f"bigtune serve: http://{args.host}:{args.port} (API pages: /docs), state in {cfg.state_dir}, backend "
          f"{service.backend.name}: {service.cfg.slots} slot(s), {c.label()}"
          + (f", jobs tracked in MLflow at {without_login(cfg.mlflow_uri)}" if cfg.mlflow_uri else ""), file=sys.stderr, flush=True)  # fmt: skip
    serve_forever(service, args.host, args.port)
    return EXIT_OK


def _mib(n) -> str:
    return f"{n / 2**20:,.1f} MiB" if n is not None else "-"


def _line(job) -> str:
    pr = job.progress
    steps = f"{pr.step}/{pr.total_steps}" if pr.total_steps else str(pr.step)
    eta = f" eta {pr.eta_s:.0f}s" if pr.eta_s and job.state == "running" else ""
    pos = f" #{job.queue_position}" if job.queue_position else ""
    mem = f"planned {_mib(job.memory.planned_peak_allocated_bytes)} measured {_mib(job.memory.measured_peak_allocated_bytes)}"
    return f"{job.id}  {job.user:<10} {job.state + pos:<12} {job.name:<24} step {steps}{eta}  {mem}"


def main_client(args) -> int:
    try:
        from bigtune.serve.client import Client, ClientError
        from bigtune.serve.schemas import JobCreate
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in SERVE_PACKAGES:
            raise  # not a missing extra: a real error, with its traceback
        return _error(NO_SERVE)
    try:
        client = Client(args.server, args.token)
        if args.verb == "submit":
            path = Path(args.recipe)
            if not path.is_file():
                return _error(f"recipe file {path} does not exist")
            request = JobCreate(recipe=path.read_text(), overrides=args.overrides, auto=args.auto,
                                priority=args.priority, hold=args.hold)  # fmt: skip
            job = client.submit(request)
            variant = f" as variant {job.variant!r}" if job.variant else ""
            print(f"{job.id} {job.state}{variant}: planned {_mib(job.memory.planned_peak_allocated_bytes)} per device")
        elif args.verb == "jobs":
            for job in client.jobs().data:
                print(_line(job))
        elif args.verb == "cancel":
            print(f"{client.cancel(args.job).id} cancelled")
        elif args.verb == "logs" and args.output:
            print(client.output(args.job).text, end="", flush=True)
        elif args.verb == "logs":
            events = client.follow(args.job) if args.follow else client.events(args.job).data
            for e in events:
                print(f"[{e.level}] {e.message}", flush=True)
    except ClientError as e:
        _error(str(e))
        for alt in e.detail.get("alternatives") or []:
            print(f"  fits: {alt.get('variant')} on {alt.get('target')}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    return EXIT_OK
