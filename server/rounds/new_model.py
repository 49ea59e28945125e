"""A round's new global model: the strategy finished (in a thread: seconds for a large model)
and checked, so that a poisoned model is never committed, checkpointed or sent to the nodes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import numpy as np

from fedgpu.core import local_params
from fedgpu.server.rounds.attempt import RoundState
from fedgpu.server.rounds.validation import first_non_finite
from fedgpu.server.strategies.base import Strategy


async def aggregate(rnd: RoundState, strategy: Strategy, lock: asyncio.Lock,
                    global_weights: dict[str, np.ndarray] | None, local: Sequence[str]
                    ) -> dict[str, np.ndarray] | None:
    """The new global model; None (and rnd.error) when it is not finite or the strategy
    refuses it (`pending_problem`). `local`: the job's local_params."""
    async with lock:
        # From here on an update that arrives is late: the strategy is being finished.
        rnd.closed = True
        t0 = time.perf_counter()
        new = await asyncio.to_thread(strategy.finish)
        bad = await asyncio.to_thread(first_non_finite, new)
        rnd.aggregation_s += time.perf_counter() - t0
    problem = (f"tensor {bad!r} of the aggregate holds NaN or Inf" if bad is not None
               else strategy.pending_problem())
    if problem is not None:
        rnd.error = (f"round {rnd.number} attempt {rnd.attempt}: {problem}; the round is "
                     "retried from the previous model")
        return None
    strategy.commit()
    # Local tensors (local_params) keep the global model's own copy: no update had them.
    return local_params.merged(global_weights or {}, new, local)
