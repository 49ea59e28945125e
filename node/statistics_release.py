"""A statistics round's answer (`mode = "statistics"`): the agent, the site's own code, turns
the worker's exact summaries (node/rounds/site_statistics.py) into the release the job's
[statistics] settings ask for — cells and columns under min_count held back, noise added
(fedgpu/core/fedstats/release.py) — so what leaves the site never depends on task code
doing it right. Torch-free: the agent imports it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedgpu.core.fedstats import wire
from fedgpu.core.fedstats.columns import summary_from_dict
from fedgpu.core.fedstats.release import Noise, ReleaseSettings, release
from fedgpu.proto import pb

log = logging.getLogger("fedgpu.node")


def settings_of(task: pb.TaskHeader) -> ReleaseSettings:
    s = task.statistics
    return ReleaseSettings(min_count=int(s.min_count), noise=Noise(s.noise or Noise.NONE),
                           epsilon=s.epsilon, delta=s.delta)


def answer(task: pb.TaskHeader, update: pb.UpdateHeader, result: Mapping[str, Any]) -> bool:
    """Put the site's release into `update`; False (and `update` marked failed with the
    reason) when the settings or the summaries cannot be used."""
    try:
        settings = settings_of(task)
        summaries = [summary_from_dict(d) for d in result.get("statistics") or []]
        if not summaries:
            raise ValueError("the round produced no statistics")
        # Seeded by the operating system: whoever knows the seed can subtract the noise.
        released = release(summaries, settings, np.random.default_rng())
        update.statistics_json = wire.dumps(released)
    except ValueError as exc:
        update.failed = True
        update.error = f"statistics not released: {exc}"
        return False
    held = sum(1 for c in released if c.suppressed)
    cells = sum(1 for c in released for v in c.histogram if v is None)
    log.info("statistics released: %d column(s), %d held back whole, %d cell(s) held back "
             "(min_count %d, noise %s)", len(released), held, cells, settings.min_count,
             settings.noise)
    return True
