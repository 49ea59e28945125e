"""`fedgpu job submit`'s question before it queues: which connected sites would refuse this
job by their own policy (fedgpu/core/site_policy.py), as they advertised it to the aggregator.

A courtesy, not a guarantee: the sites check every task themselves, and a site that changed
its policy since it registered answers by the new one. The hours a site trains are not held
against a job here (it waits for them); they are noted."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedgpu.core import admin_client
from fedgpu.core.errors import ConfigError, FedgpuError
from fedgpu.core.site_policy import JobTerms, from_dict


@dataclass
class Precheck:
    alive: int = 0
    # Per site that would refuse: its name and reasons.
    refusing: dict[str, list[str]] = field(default_factory=dict)
    # Sites that take it only at some hours: name -> the window.
    hours: dict[str, str] = field(default_factory=dict)
    # Why the check could not be made (the job is queued as before).
    skipped: str | None = None

    @property
    def accepting(self) -> int:
        return self.alive - len(self.refusing)

    def to_dict(self) -> dict[str, Any]:
        return {"alive": self.alive, "accepting": self.accepting,
                "refusing": [{"node": n, "reasons": r} for n, r in self.refusing.items()],
                "hours": [{"node": n, "window": w} for n, w in self.hours.items()],
                "skipped": self.skipped}


def precheck(address: str, token: str | None, tls: Any, terms: JobTerms) -> Precheck:
    try:
        doc = admin_client.query(address, token, "ListNodes", tls=tls)
    except FedgpuError as exc:
        return Precheck(skipped=f"could not list the sites: {exc}")
    nodes = doc.get("nodes", []) if isinstance(doc, dict) else doc
    sites = _study_sites(address, token, tls, terms.study)
    out = Precheck()
    for node in nodes if isinstance(nodes, list) else []:
        if not isinstance(node, dict) or not node.get("alive"):
            continue
        if sites is not None and node.get("name") not in sites:
            continue  # the job never samples it: its policy is not the job's concern
        out.alive += 1
        name = str(node.get("name", node.get("node_id", "?")))
        raw = node.get("site_policy")
        if not isinstance(raw, dict):
            continue
        try:
            policy = from_dict(raw, f"site {name}'s policy")
        except ConfigError:
            continue  # it decides for itself when the task comes
        reasons = policy.refusals(terms)
        if reasons:
            out.refusing[name] = reasons
        elif policy.hours is not None:
            out.hours[name] = policy.hours.text()
    return out


def _study_sites(address: str, token: str | None, tls: Any, study: str) -> set[str] | None:
    """The sites enrolled in `study` on the aggregator; None (every site) when the job names
    no study, the study does not exist (study names are labels then), or the list cannot be
    read."""
    if not study:
        return None
    try:
        doc = admin_client.query(address, token, "ListStudies", tls=tls)
    except FedgpuError:
        return None
    studies = doc.get("studies", []) if isinstance(doc, dict) else doc
    for entry in studies if isinstance(studies, list) else []:
        if isinstance(entry, dict) and entry.get("name") == study:
            return {str(s) for s in entry.get("sites") or []}
    return None
