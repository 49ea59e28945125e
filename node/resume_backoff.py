"""How long a node waits before it resumes a transfer whose stream broke (issue 37): the gRPC
path (node/wire_client.py) and the bulk path (node/bulk_client.py) follow this one rule.

Measured over the emulated WAN (benchmarks/goodput.py, 50 Mbit/s, 100 ms one way, 1% loss): a
fixed 0.5 s pause before every resume was a third of what a cut cost a 64 MiB gRPC transfer
(0.5 of ~1.4 s; the rest is the reconnect's round trips and the bytes lost in flight) and the
difference between 80-84% and the 85% goal. A stream broken by a reset, a dropped NAT entry or
a flapping link usually finds the aggregator there at once, and the channel reconnects without
gRPC's reconnect backoff (a connection that was READY and dropped goes IDLE, not into backoff),
so the first resume after a stream that moved bytes goes at once. A resume that moved nothing
(the aggregator is down or refusing) backs off, doubling to a bound, so a node never spins
against a down aggregator; the number of resumes stays bounded by the caller (GRPC_RESUMES,
bulk_client.RESUMES). The bulk path's fixed 0.5 s pause was the same share of a 64 MiB bulk
upload's cut (traced: reset seen 1-4 ms after the cut, 0.5 s asleep, then one round trip to
the go-ahead with the aggregator's offset and the rest streamed at once; 84.9-85.5% of the
link with the pause).
"""

from __future__ import annotations

# The pause after the first resume that moved no byte; doubled for each such resume in a row.
PAUSE_S = 0.5
# The longest pause: GRPC_RESUMES (5) resumes that all fail wait 0 + 0.5 + 1 + 1 + 1 s, close to
# the 2.5 s of the fixed pause before, so a stopped node's transfer thread still ends in time
# (core/lifetime.py).
MAX_PAUSE_S = 1.0


def resume_pause(stalled: int) -> float:
    """Seconds to wait before the next resume, given how many resumes in a row moved no byte
    (0: the broken stream moved some, resume at once)."""
    if stalled <= 0:
        return 0.0
    return min(PAUSE_S * 2 ** (stalled - 1), MAX_PAUSE_S)


class Progress:
    """The resumes in a row that moved no byte, from the offset held at each break."""

    def __init__(self, offset: int = 0) -> None:
        # `offset`: bytes held before the first attempt (a transfer resumed from earlier).
        self.offset = offset
        self.stalled = 0

    def pause_after(self, offset: int) -> float:
        """The pause before resuming from `offset` (bytes held now)."""
        if offset > self.offset:
            self.offset, self.stalled = offset, 0
        else:
            self.stalled += 1
        return resume_pause(self.stalled)
