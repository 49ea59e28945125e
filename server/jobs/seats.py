"""Which running job holds which site, when several jobs run at once
(`fedgpu server start --max-concurrent-jobs N`).

A site a job samples is held by that job until the job ends: its next rounds find it again.
A site trains as many jobs at once as it has slots (`fedgpu node start --slots N`, advertised
at registration; one by default): while its slots are all held, another job does not sample
it. A site with a free slot can be sampled by any job that may use it (its study, its task,
its GPUs). With one job at a time nothing else ever holds a site, so sampling is as it was.

Each running job's engine sees the federation through a `JobRoster`: the studies' rule
(server/studies.py) and then this one, as one `refusal` (server/rounds/eligibility.py asks it).
"""

from __future__ import annotations

from typing import Any

from fedgpu.server.registry import Node


class Seats:
    def __init__(self) -> None:
        # site name -> the ids of the running jobs holding it, in the order they took it.
        self._held: dict[str, list[str]] = {}

    def holders(self, site: str, besides: str = "") -> list[str]:
        return [j for j in self._held.get(site, ()) if j != besides]

    def busy_with(self, job_id: str, node: Node) -> str | None:
        """The job(s) holding `node`'s every slot, so that `job_id` may not sample it
        ("4f2a", or "4f2a, 9c1e" for a site of two slots); None when it may."""
        others = self.holders(node.name, besides=job_id)
        if len(others) < node.slots or job_id in self._held.get(node.name, ()):
            return None
        return ", ".join(others)

    def claim(self, job_id: str, nodes: list[Node]) -> None:
        for node in nodes:
            held = self._held.setdefault(node.name, [])
            if job_id not in held:
                held.append(job_id)

    def release(self, job_id: str) -> list[str]:
        """Free every site `job_id` held (it ended); the names of those sites."""
        freed = []
        for site, held in list(self._held.items()):
            if job_id in held:
                held.remove(job_id)
                freed.append(site)
            if not held:
                del self._held[site]
        return freed


class JobRoster:
    """One job's view of who it may sample: its study's sites, not held by another job."""

    def __init__(self, job_id: str, seats: Seats, studies: Any = None) -> None:
        self.job_id = job_id
        self.seats = seats
        self.studies = studies

    def refusal(self, study: str | None, node: Node) -> str | None:
        if self.studies is not None:
            outside = self.studies.refusal(study, node)
            if outside is not None:
                return outside
        holder = self.seats.busy_with(self.job_id, node)
        if holder is None:
            return None
        if node.slots == 1:
            return f"busy with job {holder}"
        return f"its {node.slots} slots are busy with jobs {holder}"

    def claim(self, nodes: list[Node]) -> None:
        self.seats.claim(self.job_id, nodes)
