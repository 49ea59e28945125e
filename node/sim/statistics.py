"""A simulated node's answer to a statistics task (`mode = "statistics"`): synthetic columns of
the same kind the packaged tasks declare (a bounded feature with several values per record, and
a class label), summarised and released by the site's own code (node/statistics_release.py),
so min_count suppression and noise apply exactly as on a real site. No torch, no data files.

The values are drawn from the node's index alone, as a site's data stays the same from job to
job: every job sees the same release, and sites differ (their record counts do too), so
combined figures are not one site's figures times K.
"""

from __future__ import annotations

import numpy as np

from fedgpu.core.fedstats.columns import ColumnSpec, summarize, summary_to_dict
from fedgpu.node.statistics_release import answer as release_answer
from fedgpu.proto import pb

# Four feature values per record (as a digits image gives 64 pixels): per_record makes a
# cell's threshold min_count * 4 values, so small sites show suppression at the defaults.
FEATURE = ColumnSpec(name="feature", lo=0.0, hi=1.0, bins=16, per_record=4)
LABEL = ColumnSpec(name="label", lo=0.0, hi=10.0, bins=10)
COLUMNS = (FEATURE, LABEL)


def columns(index: int, records: int) -> list[tuple[ColumnSpec, np.ndarray]]:
    """(spec, values) per column, as a task's statistics() hook returns them."""
    rng = np.random.default_rng([index, 0x5747])
    # Skewed per site (a Beta whose shape moves with the index) and labels from a site-specific
    # mix, as non-IID sites are.
    a = 1.0 + index % 5
    feature = rng.beta(a, 3.0, size=(records, FEATURE.per_record))
    weights = rng.dirichlet(np.full(10, 0.5))
    labels = rng.choice(10, size=records, p=weights).astype(np.float64)
    return [(FEATURE, feature), (LABEL, labels)]


def answer(task: pb.TaskHeader, update: pb.UpdateHeader, index: int, records: int) -> bool:
    """Put the node's release into `update` (statistics_json), as the agent does; False with
    `update` marked failed when the job's release settings cannot be used."""
    summaries = [summary_to_dict(summarize(spec, values))
                 for spec, values in columns(index, records)]
    return release_answer(task, update, {"statistics": summaries})
