"""How long a submitted job would take on the sites it can reach, from their measured speed.

A job that would run for hours on a CPU site should say so when it is submitted, not after
the first round's deadline. Nodes report `examples_per_s` with every training update; the
registry keeps the latest per task (Node.throughput). The estimate is deliberately rough: a
synchronous round waits for its slowest sampled site, so each round is costed at the slowest
measured site that offers the task, times the job's rounds. Transfer, evaluation and
aggregation time are left out (small beside training where the estimate matters).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from fedgpu.core import task_schemas
from fedgpu.core.constants import Mode
from fedgpu.core.hetero_config import LocalWork
from fedgpu.core.job import Job
from fedgpu.server.registry import Node

# An estimate longer than this is worth a warning at submit.
LONG_S = 3600.0


def _hp(job: Job, key: str, fallback: float) -> float:
    value = job.hyperparameters.get(key)
    if value is None:
        value = (task_schemas.allowed(job.task) or {}).get(key, fallback)
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return fallback
    return number if math.isfinite(number) else fallback


def round_seconds(job: Job, node: Node) -> float | None:
    """One round's training time on `node`; None when it has no measured speed for the task."""
    if job.hetero.local_work is LocalWork.TIME and job.hetero.round_train_s:
        return job.hetero.round_train_s
    speed = node.throughput.get(job.task)
    if not speed or not node.stated_examples:
        return None
    examples = _hp(job, "local_epochs", 1.0) * node.stated_examples
    steps = _hp(job, "max_steps", 0.0)
    if steps > 0:
        examples = min(examples, steps * _hp(job, "batch_size", 64.0))
    seconds = examples / speed
    cap = _hp(job, "max_train_seconds", 0.0)
    return min(seconds, cap) if cap > 0 else seconds


def estimate(job: Job, nodes: Iterable[Node]) -> dict[str, Any] | None:
    """The job's training time on the live nodes that offer its task; None when no such node
    has trained the task yet (nothing measured to go by), or the job trains nothing."""
    if job.mode in (Mode.EVALUATE, Mode.CROSS_SITE):
        return None
    offering = [n for n in nodes if not n.tasks or job.task in n.tasks]
    costed = [(s, n) for n in offering if (s := round_seconds(job, n)) is not None]
    if not costed:
        return None
    per_round, slowest = max(costed, key=lambda pair: pair[0])
    total = per_round * job.rounds
    est: dict[str, Any] = {
        "seconds": round(total, 1),
        "per_round_s": round(per_round, 2),
        "slowest": slowest.name,
        "examples_per_s": slowest.throughput.get(job.task),
        "sites_measured": len(costed),
        "sites_unmeasured": len(offering) - len(costed),
        "long": total > LONG_S,
    }
    est["text"] = describe(est)
    return est


def describe(est: dict[str, Any]) -> str:
    """One line for people: 'about 3 h 10 min of training (...)'."""
    speed = est.get("examples_per_s")
    why = (f"slowest site {est['slowest']} at {speed:g} examples/s" if speed
           else f"slowest site {est['slowest']}")
    line = (f"about {duration(est['seconds'])} of training ({duration(est['per_round_s'])} a "
            f"round; {why}")
    if est.get("sites_unmeasured"):
        line += f"; {est['sites_unmeasured']} site(s) not measured yet"
    line += ")"
    if est.get("long"):
        line += ("; fewer rounds, a smaller model or local_work = \"time\" with "
                 "round_train_s would bound it")
    return line


def duration(seconds: float) -> str:
    # "about 0 s of training" read as nothing to do; a short job says how short it is.
    if seconds < 1:
        return "under 1 s"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = seconds / 60
    if minutes < 90:
        return f"{minutes:.0f} min"
    hours, rest = divmod(round(minutes), 60)
    return f"{hours} h {rest} min" if rest else f"{hours} h"
