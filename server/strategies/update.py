"""One accepted update as a strategy receives it: its tensors and what its strategy's table
row asks for besides (fedgpu/core/job/strategies.py, `needs`). server/rounds/work.py builds it
from the row, so a strategy never has to say by a signature what it reads."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class UpdateIn:
    # Arrays, or block sources of a compressed update (fedgpu.core.update_codecs).
    tensors: Mapping[str, Any]
    # The examples it was trained on (UpdateNeed.EXAMPLES: the weight of a weighted mean).
    num_examples: float
    # The optimizer steps it took (UpdateNeed.LOCAL_STEPS, FedNova); None where not asked for.
    local_steps: float | None = None
    # Model versions since its task was sent (UpdateNeed.STALENESS, FedBuff).
    staleness: int = 0
