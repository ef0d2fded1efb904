"""Load on the training service (issue #45, Must show 2): N tiny jobs sent at once by several users to a service
with 2 slots, over real HTTP on 127.0.0.1.

    python bench/serve_load.py [--jobs 20] [--users 3] [--slots 2] [--steps 2] [--timeout 1800] [--json OUT]

The service (local backend, its slots standing in for GPUs on a CPU machine) runs in this process on a free port,
with its state in a temporary folder. One thread per job sends its recipe at the same moment (a barrier), as its
user, with priority ``i % 3``; then the bench waits (bounded) until every job has ended and checks, from the
service's own records (each job's attempts and their start and end times):

- every job is there and succeeded: none lost;
- each ran once (one attempt, no retry) and its run logged steps 1..steps once each: none run twice;
- never more than ``--slots`` attempts ran at the same time;
- the start order is the policy's (bigtune.serve.policy): when a job started, no job that had been waiting for
  over a second and ranked before it (effective priority, then submission) was still waiting.

Prints the figures (submission latency p50 and p95, jobs per minute from the first submission to the last end)
and a figure line; ``--json`` writes them (a temporary name, then a rename). Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the jobs share the machine's cores: one thread each

import httpx  # noqa: E402

from bigtune.serve.policy import effective_priority  # noqa: E402
from bigtune.serve.server import InThread  # noqa: E402
from bigtune.serve.service import ServeConfig  # noqa: E402
from bigtune.serve.store import TERMINAL  # noqa: E402

START_SLACK_S = 1.0  # a job queued less than this before another started may not have been seen by that tick


def tiny_recipe(name: str, steps: int) -> dict:
    """The bundled tiny Llama on the demo data: seconds per job on a CPU."""
    return {
        "name": name,
        "model": {"name": "tiny-llama"},
        "data": {"source": "demo", "max_seq_length": 64},
        "train": {"micro_batch_size": 4, "max_steps": steps, "max_epochs": None, "log_every_steps": 1},
        "checkpoint": {"save_model": False},
        "memory": {"plan": False},
        "accelerator": "cpu",
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def submit_all(url: str, tokens: dict[str, str], n_jobs: int, steps: int) -> list[dict]:
    """Every job sent at once, one thread each: [{user, priority, status, id, latency_s, error}] in job order."""
    users = list(tokens)
    barrier = threading.Barrier(n_jobs)
    out: list[dict] = [{} for _ in range(n_jobs)]

    def send(i: int) -> None:
        user, priority = users[i % len(users)], i % 3
        body = {"recipe": tiny_recipe(f"load-{i:02d}", steps), "priority": priority}
        barrier.wait()
        t0 = time.monotonic()
        try:
            res = httpx.post(f"{url}/v1/jobs", json=body, headers={"Authorization": f"Bearer {tokens[user]}"},
                             timeout=600)  # fmt: skip
            ok = res.status_code == 201
            out[i] = {"user": user, "priority": priority, "status": res.status_code,
                      "id": res.json()["id"] if ok else None, "error": None if ok else res.text[:300]}  # fmt: skip
        except httpx.HTTPError as e:
            out[i] = {"user": user, "priority": priority, "status": None, "id": None, "error": str(e)}
        out[i]["latency_s"] = time.monotonic() - t0

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n_jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def wait_all(url: str, admin: str, ids: list[str], timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=60) as http:
        while True:
            listed = {j["id"]: j for j in http.get("/v1/jobs").json()["data"]}
            jobs = [http.get(f"/v1/jobs/{i}").json() if i in listed else {"id": i, "state": "lost"} for i in ids]
            if all(j["state"] in (*TERMINAL, "lost") for j in jobs) or time.monotonic() > deadline:
                return jobs
            time.sleep(1.0)


def most_at_once(attempts: list[dict]) -> int:
    """The most attempts running at one time (an end at the same instant as a start counts first)."""
    edges = sorted([(a["started_at"], 1) for a in attempts] + [(a["ended_at"] or float("inf"), -1) for a in attempts])
    most = now = 0
    for _, d in edges:
        now += d
        most = max(most, now)
    return most


def order_violations(jobs: list[dict], aging_s: float) -> list[str]:
    """Starts the policy would not have made: at a job's start, a job waiting (over START_SLACK_S) that ranks
    before it by the policy's key and started later."""
    from bigtune.serve.policy import Waiting

    started = [(j, j["attempts"][0]["started_at"]) for j in jobs if j.get("attempts")]
    bad = []
    for job, t in started:

        def key(j: dict) -> tuple:
            w = Waiting(j["id"], j["user"], j["priority"], j["slots"], j["created_at"])
            return (-effective_priority(w, t, aging_s), j["created_at"], j["id"])

        for other, t_other in started:
            waiting = other["created_at"] < t - START_SLACK_S and t_other > t
            if waiting and key(other) < key(job):
                bad.append(f"{job['id']} (priority {job['priority']}) started before {other['id']} "
                           f"(priority {other['priority']}, waiting since {t - other['created_at']:.1f} s)")  # fmt: skip
    return bad


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def write_json(path: Path, result: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)


def run(args: argparse.Namespace, state: Path) -> dict:
    cfg = ServeConfig(state_dir=state / "state", slots=args.slots, workdir=state, allowed_roots=(state,),
                      tick_s=0.2, max_retries=0)  # fmt: skip
    server = InThread(cfg, port=free_port()).start()
    try:
        tokens = {f"user{u + 1}": server.service.add_token(f"user{u + 1}") for u in range(args.users)}
        admin = server.service.add_token("bench", admin=True)
        t0 = time.time()
        sent = submit_all(server.url, tokens, args.jobs, args.steps)
        ids = [s["id"] for s in sent if s["id"]]
        jobs = wait_all(server.url, admin, ids, args.timeout)
    finally:
        server.stop()
    ended = [j.get("finished_at") for j in jobs if j.get("finished_at")]
    wall_s = (max(ended) - t0) if ended else None
    attempts = [a for j in jobs for a in j.get("attempts", [])]
    twice = []
    for j in jobs:
        steps = [m["step"] for m in _read_jsonl(Path(j["run_dir"]) / "metrics.jsonl")] if j.get("run_dir") else []
        if len(j.get("attempts", [])) != 1 or j.get("retries") or steps != list(range(1, args.steps + 1)):
            twice.append(j["id"])
    latencies = [s["latency_s"] for s in sent]
    result = {
        "jobs": args.jobs, "users": args.users, "slots": args.slots, "steps": args.steps,
        "refused": [s for s in sent if not s["id"]],
        "states": {s: sum(j["state"] == s for j in jobs) for s in sorted({j["state"] for j in jobs})},
        "lost": [j["id"] for j in jobs if j["state"] == "lost"],
        "not_once": twice,
        "most_at_once": most_at_once(attempts),
        "order_violations": order_violations([j for j in jobs if j["state"] != "lost"], cfg.aging_s),
        "submit_latency_s": {"p50": percentile(latencies, 50), "p95": percentile(latencies, 95), "max": max(latencies)},
        "wall_s": wall_s,
        "jobs_per_min": len(ended) / wall_s * 60 if wall_s else None,
        "job_s_mean": statistics.mean(a["ended_at"] - a["started_at"] for a in attempts if a["ended_at"]) if attempts else None,
        "cpus": os.cpu_count(),
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0)),
    }  # fmt: skip
    result["ok"] = (
        not result["refused"] and result["states"] == {"succeeded": args.jobs} and not result["lost"]
        and not twice and result["most_at_once"] <= args.slots and not result["order_violations"]
    )  # fmt: skip
    return result


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=20)
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="training steps per job")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds to wait for every job to end")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bigtune-serve-load-") as tmp:
        r = run(args, Path(tmp))
    lat = r["submit_latency_s"]
    print(f"jobs: {r['states']} of {r['jobs']} sent by {r['users']} users; refused {len(r['refused'])}, "
          f"lost {len(r['lost'])}, not run exactly once {len(r['not_once'])}")  # fmt: skip
    print(f"most running at once: {r['most_at_once']} (slots {r['slots']}); policy order violations: "
          f"{len(r['order_violations'])}")  # fmt: skip
    for v in r["order_violations"][:5]:
        print(f"  {v}")
    print(f"submission latency: p50 {lat['p50']:.2f} s, p95 {lat['p95']:.2f} s, max {lat['max']:.2f} s")
    if r["wall_s"]:
        print(f"{r['jobs_per_min']:.1f} jobs/min: {r['wall_s']:.0f} s from the first submission to the last end "
              f"(a job's attempt {r['job_s_mean']:.1f} s on average, {r['cpus']} CPUs)")  # fmt: skip
    print(f"FIGURE serve_load jobs={r['jobs']} users={r['users']} slots={r['slots']} ok={r['ok']} "
          f"max_at_once={r['most_at_once']} submit_p50_s={lat['p50']:.2f} submit_p95_s={lat['p95']:.2f} "
          f"jobs_per_min={(r['jobs_per_min'] or 0):.1f}")  # fmt: skip
    if args.json:
        write_json(Path(args.json), r)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
