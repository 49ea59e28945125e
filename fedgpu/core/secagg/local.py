"""One secure-aggregation round with every party in this process: the reference driver.

Each message goes through its byte encoding, as it would over the wire. `drop` names, per stage,
the sites that vanish instead of answering it; a site whose own checks refuse a step drops out
the same way. Tests use it to check the protocol end to end, and `observe` sees every encoded
message the aggregator receives (what an honest-but-curious aggregator could look at).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from fedgpu.core.secagg.aggregator import AggregatorSession, Outcome
from fedgpu.core.secagg.errors import SecAggError, Stage
from fedgpu.core.secagg.messages import (
    KeyRelay,
    MaskedInput,
    PublicKeys,
    Setup,
    ShareKeys,
    ShareRelay,
    UnmaskReply,
    UnmaskRequest,
)
from fedgpu.core.secagg.noise_share import NoiseShare
from fedgpu.core.secagg.params import Settings
from fedgpu.core.secagg.site import SiteSession

Observer = Callable[[Stage, int, bytes], None]


def run_local(updates: Sequence[np.ndarray], weights: Sequence[float], settings: Settings,
              drop: Mapping[Stage, set[int]] | None = None, observe: Observer | None = None,
              seed: int | None = None, graph_seed: bytes | None = None,
              noise: NoiseShare | None = None, stated: Sequence[int] | None = None,
              metrics: Sequence[Mapping[str, float]] | None = None,
              ) -> tuple[Outcome, AggregatorSession]:
    """Sites 1..n hold updates[i-1] with weights[i-1] (`stated`: the training-set sizes they
    stated at registration, which bound the round's weights); returns the outcome and the
    aggregator (for inspection). Raises BelowThreshold when too few sites survive a stage.
    `noise`: every site adds its distributed-DP share (noise_share.py) before masking.
    `metrics`: each site's train metrics, masked after the weight (masked_metrics.py)."""
    drop = drop or {}
    n = len(updates)
    params = settings.resolve(n, int(updates[0].size), list(stated) if stated else None,
                              metrics=metrics is not None)
    agg = AggregatorSession(params, graph_seed=graph_seed)
    rng = np.random.default_rng(seed)
    sites = {i: SiteSession(Setup.decode(s.encode()), rng)
             for i, s in agg.start().items()}

    def step(stage: Stage, outgoing: Mapping[int, bytes],
             answer: Callable[[SiteSession, bytes], bytes], receive: Callable[[bytes], None],
             ) -> None:
        for i, data in outgoing.items():
            if i in drop.get(stage, ()):
                del sites[i]
                continue
            try:
                reply = answer(sites[i], data)
            except SecAggError:
                del sites[i]
                continue
            if observe is not None:
                observe(stage, i, reply)
            receive(reply)

    step(Stage.ADVERTISE_KEYS, {i: b"" for i in list(sites)},
         lambda s, _: s.advertise().encode(),
         lambda b: agg.receive_keys(PublicKeys.decode(b)))
    step(Stage.SHARE_KEYS, {i: m.encode() for i, m in agg.close_keys().items()},
         lambda s, b: s.share_keys(KeyRelay.decode(b)).encode(),
         lambda b: agg.receive_shares(ShareKeys.decode(b)))
    step(Stage.MASKED_INPUT, {i: m.encode() for i, m in agg.close_shares().items()},
         lambda s, b: s.masked_input(ShareRelay.decode(b), np.asarray(updates[s.me - 1]),
                                     weights[s.me - 1], noise, None,
                                     metrics[s.me - 1] if metrics else None).encode(),
         lambda b: agg.receive_masked(MaskedInput.decode(b)))
    step(Stage.UNMASK, {i: m.encode() for i, m in agg.close_masked().items()},
         lambda s, b: s.unmask(UnmaskRequest.decode(b)).encode(),
         lambda b: agg.receive_unmask(UnmaskReply.decode(b)))
    return agg.finish(), agg
