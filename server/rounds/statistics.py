"""`mode = "statistics"`: one round in which every chosen site summarises its data and sends
its release (fedgpu/core/fedstats/); no model travels either way, nothing is trained.

The plan asks the sites (a seeded sample, as a star round: `fraction`, `min_nodes`), reads
each accepted answer's document with the limits and checks of fedgpu/core/fedstats/wire.py (a
bad one is refused as MALFORMED: listed, counted, and no part of the combination), and when
the round closes puts the per-site and combined figures into the round's record under
`statistics`, where `fedgpu job status`, `fedgpu rounds` and the dashboard read them.

The engine runs it as a one-round job whose model is empty (server/jobs/queue.py gives it no
tensors): nothing to initialise, nothing to aggregate, and the checkpoint after the round
stores the history with the figures, so a restarted aggregator serves them.
"""

from __future__ import annotations

import logging
from typing import Any

from fedgpu.core.fedstats import wire
from fedgpu.core.fedstats.combine import combine
from fedgpu.core.fedstats.release import ColumnRelease
from fedgpu.core.job import Job
from fedgpu.proto import pb
from fedgpu.server.registry import Node
from fedgpu.server.rejections import Reject, UpdateRejected
from fedgpu.server.rounds.attempt import RoundState
from fedgpu.server.rounds.plans import StarPlan
from fedgpu.server.rounds.records import RoundRecord, UpdateRecord

log = logging.getLogger("fedgpu.server.rounds.engine")


class StatsPlan(StarPlan):
    """A star round of kind STATISTICS. Its strategy (the job's, FedAvg by default) is never
    fed: the plan does not aggregate; the engine only needs one to exist."""

    kind = pb.TASK_KIND_STATISTICS
    sends_model = False
    aggregates = False
    recorded = True
    advances = True

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        assert job.statistics is not None, "a statistics job has [statistics] (defaults)"
        self.settings = job.statistics
        # The accepted releases of the open attempt, by site name.
        self.releases: dict[str, list[ColumnRelease]] = {}

    def task_fields(self, number: int, attempt: int, chosen: list[Node]
                    ) -> list[dict[str, Any]]:
        self.releases = {}
        s = self.settings
        release = pb.StatisticsRelease(min_count=s.min_count, noise=s.noise, epsilon=s.epsilon,
                                       delta=s.delta)
        return [{**f, "statistics": release}
                for f in super().task_fields(number, attempt, chosen)]

    def on_update(self, update: UpdateRecord, header: pb.UpdateHeader) -> None:
        """Read the site's document; UpdateRejected (MALFORMED) when it cannot be used, which
        refuses the whole answer (server/rounds/receive.py lists and counts it)."""
        try:
            self.releases[update.node] = wire.loads(header.statistics_json)
        except ValueError as exc:
            raise UpdateRejected(Reject.MALFORMED, f"statistics from {update.node} refused: "
                                 f"{exc}") from None

    def closed(self, rnd: RoundState, record: RoundRecord | None, chosen: list[Node],
               ok: bool) -> str:
        error = super().closed(rnd, record, chosen, ok)
        if not ok and rnd.failures:
            # The site's own words (e.g. a task without a statistics() hook) reach the job.
            error = f"{rnd.failures[-1].node}: {rnd.failures[-1].error}"
        if record is not None:
            accepted = {u.node for u in rnd.updates}
            doc = combine({site: cols for site, cols in sorted(self.releases.items())
                           if site in accepted})
            doc["release"] = {"min_count": self.settings.min_count, "noise": self.settings.noise,
                              "epsilon": self.settings.epsilon, "delta": self.settings.delta}
            record.extra["statistics"] = doc
            if ok:
                log.info("statistics of %d site(s): %s", len(doc["sites"]),
                         ", ".join(f"{name} n={col.get('count', 0):g}"
                                   for name, col in doc["combined"].items()))
        return error
