"""How the aggregator is stopping, shared by the services that answer nodes and operators.

A stop is a restart unless said otherwise: nodes keep their registration, their polls end with
UNAVAILABLE ("poll again"), and they come back when the aggregator does. Only a retirement
(`fedgpu server stop --retire-nodes`, or the end of a `fedgpu run`) tells every node to exit.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass
class Lifecycle:
    # Set to stop the aggregator (a signal, `fedgpu server stop`).
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    # Non-empty: every node is told it is retired, with this reason, and exits.
    retire: str = ""
    # The stop came from `fedgpu server stop` (else from a signal), for the log.
    requested: bool = False

    def request_stop(self, retire: str = "") -> None:
        self.requested = True
        if retire:
            self.retire = retire
        self.stop.set()
