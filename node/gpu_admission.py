"""GPU admission of a task beside the site's other running tasks (`fedgpu node start --slots N`).

Each task is admitted on its own (node/policy.py decide_for_job: the site's --gpu flags, the
job's [resources]), but a second task must not pass by reading free memory that the first has
been admitted to but not yet allocated (its worker is still importing torch). So each admitted
task holds, until it ends, the memory it was admitted for on its device: its cap (the share of
the card a memory fraction gives it) or else the free memory it demanded (the site's
--gpu-min-free-mib, the job's min_gpu_free_mib). A later task is decided against NVML's free
memory less what the running tasks hold; one that does not fit is refused ("ineligible", the
aggregator samples it again later) with the reason, naming the memory the other tasks hold.

Conservative on purpose: once the first task has allocated, NVML's free memory already shows
it and the hold is subtracted again; a site sharing a card between jobs states each job's
needs (or --gpu-memory-fraction) so that the arithmetic is exact rather than lucky. A task that
states nothing holds nothing: the site's policy did not ask for any memory.

With one slot nothing is ever held when a task is admitted: decisions are exactly the policy's.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from fedgpu.core import admission
from fedgpu.core.job.resources import Resources
from fedgpu.node import nvml, policy
from fedgpu.node.gpu_records import GpuRecord, NvmlSnapshot
from fedgpu.node.worker_devices import decisions_for


class GpuAdmission:
    def __init__(self, flags: policy.GpuFlags) -> None:
        self.flags = flags
        # One admission at a time: read, decide and hold without another slot in between.
        self._lock = threading.Lock()
        # task id -> {device uuid: MiB held}
        self._held: dict[str, dict[str, int]] = {}

    def admit(self, task_id: str, need: Resources, parallel: bool,
              snapshot: NvmlSnapshot | None = None
              ) -> tuple[policy.Decision, tuple[policy.Decision, ...]]:
        """The task's decision and its workers' (several for a data-parallel train task), its
        memory held until `release`. Raises policy.Ineligible with the reason (and what the
        other tasks hold) when the job cannot run beside them; EnforceError/ValueError as
        the policy does."""
        with self._lock:
            live = snapshot if snapshot is not None else nvml.snapshot()
            snap = self.less_held(live)
            try:
                decision = policy.decide_for_job(snap, self.flags, need)
                decisions = (decisions_for(snap, self.flags, need, decision) if parallel
                             else (decision,))
            except policy.Ineligible as exc:
                note = self.note()
                raise policy.Ineligible(f"{exc}{note}") from None
            self._held[task_id] = held_by(decisions, need, self.flags, snap)
            return decision, decisions

    def release(self, task_id: str) -> None:
        with self._lock:
            self._held.pop(task_id, None)

    def held(self) -> dict[str, int]:
        """MiB held per device by the running tasks."""
        out: dict[str, int] = {}
        for per_task in self._held.values():
            for uuid, mib in per_task.items():
                out[uuid] = out.get(uuid, 0) + mib
        return out

    def note(self) -> str:
        held = {u: m for u, m in self.held().items() if m > 0}
        if not held:
            return ""
        shown = ", ".join(f"{m} MiB of {u}" for u, m in sorted(held.items()))
        return (f" (this site's other running tasks hold {shown}: it runs several jobs at "
                "once, --slots)")

    def less_held(self, snapshot: NvmlSnapshot) -> NvmlSnapshot:
        """The snapshot with each device's free memory less what running tasks hold."""
        held = self.held()
        if not held:
            return snapshot
        return replace(snapshot, gpus=tuple(_less(g, held) for g in snapshot.gpus))


def held_by(decisions: tuple[policy.Decision, ...], need: Resources, flags: policy.GpuFlags,
            snapshot: NvmlSnapshot) -> dict[str, int]:
    """The memory a task admitted with `decisions` holds on each of its devices (MiB)."""
    site = policy.capacity(snapshot, flags)
    demanded = admission.minimum_free(need, site)
    totals = {g.uuid: g.memory_total_mib for g in _all(snapshot.gpus)}
    out: dict[str, int] = {}
    for d in decisions:
        if d.device != "cuda" or not d.gpu_uuid:
            continue
        total = totals.get(d.gpu_uuid)
        capped = (int(d.memory_fraction * total) if d.memory_fraction is not None
                  and total is not None else 0)
        out[d.gpu_uuid] = out.get(d.gpu_uuid, 0) + max(capped, need.gpu_memory_mib or 0,
                                                       demanded)
    return out


def _all(gpus: tuple[GpuRecord, ...]) -> list[GpuRecord]:
    return [d for g in gpus for d in (g, *g.mig_devices)]


def _less(g: GpuRecord, held: dict[str, int]) -> GpuRecord:
    migs = tuple(_less(m, held) for m in g.mig_devices)
    take = held.get(g.uuid, 0)
    free = g.memory_free_mib
    if take and free is not None:
        free = max(0, free - take)
    return replace(g, memory_free_mib=free, mig_devices=migs)
