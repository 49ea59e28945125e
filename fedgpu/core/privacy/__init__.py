"""Client-level differential privacy: the job file's `[privacy]` table, the pure numpy
mechanisms (clipping an update's L2 norm, Gaussian noise, adaptive clipping) and the accountant
that turns rounds into (epsilon, delta).

Pure numpy and dp-accounting, no torch: the aggregator (central mode) and the node (local mode)
share it. Example-level DP-SGD on the node is Opacus's, in node/rounds/dp_sgd.py.
"""

from __future__ import annotations

from fedgpu.core.privacy.settings import (
    ACCOUNTANTS,
    BUDGET_SPENT_REASON,
    PrivacyMode,
    PrivacySettings,
    parse_privacy,
)

__all__ = [
    "ACCOUNTANTS",
    "BUDGET_SPENT_REASON",
    "PrivacyMode",
    "PrivacySettings",
    "parse_privacy",
]
