"""The queue's order: which waiting jobs start now, a pure function of (jobs, free slots, usage, quotas, time).

The policy, in full:

1. **Order.** Waiting jobs are ranked by *effective priority* = the priority asked for + one level for every
   ``aging_s`` seconds waited (default 600 s), highest first; the earlier submission breaks ties. Aging is what
   lets a low-priority job reach the head of the queue at all while higher-priority work keeps arriving.
2. **Quota.** A user with a GPU-hour quota is not started while their used GPU-hours (slots × hours run,
   finished and running jobs alike) plus the job's planned GPU-hours would exceed it; the job stays queued with
   the reason, and does not hold up anyone else.
3. **Reservation for the head.** Jobs start in that order while their slots are free. The first job that does not
   fit in the free slots becomes the *head*: the slots freed from then on are reserved for it, and no job behind it
   starts, however small (no backfill). Without this a large job would starve behind a stream of small ones, each
   taking a slot the moment one is freed; with it, a large job waits at most for the jobs running when it reached
   the head. The price is idle slots while the head waits; EASY backfill (start a small job only if its planned
   end comes before the head's reserved start) would recover them and is not built.
4. **Backoff.** A job whose worker died waits out its retry backoff (``not_before``) without blocking others.
5. **Pools.** Where the cluster's slots come in separate pools (the Slurm partitions of a cluster profile, each job
   admitted to one), rules 3 and 4 hold within each pool: a job starts when its own pool has the slots, and the
   head of one pool reserves that pool's slots only. Order (rule 1) and quotas (rule 2) are the same for all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

AGING_S = 600.0


@dataclass(frozen=True)
class Waiting:
    """A queued job as the policy sees it. Times are seconds since the epoch."""

    id: str
    user: str
    priority: int
    slots: int
    queued_at: float
    not_before: float = 0.0
    planned_gpu_hours: Optional[float] = None  # None: the plan has no time estimate (counted as 0)
    pool: str = ""  # the slots it runs on: a Slurm partition of a cluster profile; "" one pool for all


@dataclass
class Decision:
    """``start``: ids to start now, in order; ``order``: every waiting job in the queue's order (its position
    is index + 1); ``blocked``: why each job that does not start waits."""

    start: list[str] = field(default_factory=list)
    order: list[str] = field(default_factory=list)
    blocked: dict[str, str] = field(default_factory=dict)


def effective_priority(job: Waiting, now: float, aging_s: float = AGING_S) -> float:
    """The priority asked for plus one level per ``aging_s`` seconds waited."""
    return job.priority + max(0.0, now - job.queued_at) / aging_s


def schedule(
    waiting: list[Waiting],
    free_slots: int | dict[str, int],
    used_gpu_hours: dict[str, float],
    quotas: dict[str, float],
    now: float,
    aging_s: float = AGING_S,
) -> Decision:
    """Which of ``waiting`` start now on ``free_slots`` (the module's docstring states the policy): a number, or
    the free slots of each pool."""
    order = sorted(waiting, key=lambda j: (-effective_priority(j, now, aging_s), j.queued_at, j.id))
    out = Decision(order=[j.id for j in order])
    used = dict(used_gpu_hours)
    free = dict(free_slots) if isinstance(free_slots, dict) else {"": free_slots}
    heads: dict[str, Waiting] = {}
    for job in order:
        if job.not_before > now:
            out.blocked[job.id] = f"retry backoff: starts again in {job.not_before - now:.0f} s at the earliest"
            continue
        quota = quotas.get(job.user)
        need_hours = job.planned_gpu_hours or 0.0
        if quota is not None and used.get(job.user, 0.0) + need_hours > quota:
            out.blocked[job.id] = (
                f"over quota: {job.user} has used {used.get(job.user, 0.0):.2f} of {quota:.2f} GPU-hours and this "
                f"job plans {need_hours:.2f}; an admin can raise the quota (--quota {job.user}=HOURS)"
            )
            continue
        pool = f" of partition {job.pool}" if job.pool else ""
        if (head := heads.get(job.pool)) is not None:
            out.blocked[job.id] = (
                f"behind {head.id}, which waits for {head.slots} slots{pool}: they are reserved for it"
            )
            continue
        if job.slots <= free.get(job.pool, 0):
            out.start.append(job.id)
            free[job.pool] -= job.slots
            used[job.user] = used.get(job.user, 0.0) + need_hours
        else:
            heads[job.pool] = job
            out.blocked[job.id] = (
                f"head of the queue{pool}: waits for {job.slots} free slots ({free.get(job.pool, 0)} free now)"
            )
    return out
