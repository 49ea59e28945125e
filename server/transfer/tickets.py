"""One-time tickets for the bulk port: the gRPC control plane decides who may move which
payload, the bulk connection only proves it holds that decision.

A ticket is a random token bound to a node, a task, a direction and a size; it expires within
seconds and is spent by the first connection that presents it. A ticket whose connection broke
before its transfer finished may be presented again, within RESUME_TTL_S of the break, to
resume that transfer (the resume ticket): it is still bound to the same node, task, direction,
size and (for uploads) header with its payload digest, so presenting it can only continue the
one payload it was issued for. Under mutual TLS the bulk connection's certificate must name the
ticket's node, on every presentation. Every refusal is counted by reason
(`status --json` `bulk.refused`), and tokens spent or expired recently are remembered, so a
replayed ticket is told apart from a made-up one.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from fedgpu.core.bulk import RESUME_TTL_S, Direction
from fedgpu.proto import pb

DEFAULT_TTL_S = 30.0
# Tickets outstanding at once: one per direction per node in a round, with room to spare;
# when full, the oldest goes (its node asks again, or falls back to gRPC).
MAX_TICKETS = 20_000
# Spent or expired tokens remembered, to name replays as such.
MAX_SPENT = 20_000


class TicketRefusal(StrEnum):
    """Why a bulk connection was turned away (the counter keys of `status --json` `bulk`)."""

    UNKNOWN = "unknown"          # never issued (forged, or from before a restart)
    USED = "used"                # already spent by an earlier connection
    EXPIRED = "expired"          # not presented in time
    WRONG_PEER = "wrong_peer"    # mutual TLS: the certificate is not the ticket's node's
    MALFORMED = "malformed"      # not a bulk conversation (bad magic, bad frame)
    HANDSHAKE = "handshake"      # TLS handshake failed, or no ticket before the timeout
    BUSY = "busy"                # too many bulk connections at once


class TicketRefused(Exception):
    def __init__(self, reason: TicketRefusal, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass
class Ticket:
    token: str
    direction: Direction
    node_id: str
    node_name: str
    task_id: str
    size: int
    expires: float
    # Uploads: the header checked when the ticket was issued, checked again on arrival.
    header: pb.UpdateHeader | None = None
    # Presented at least once: from then on `expires` is the resume deadline.
    opened: bool = False
    # A download sent to its end: the node may still be missing the bytes that were in flight
    # when its side broke, so it may resume (from an offset) but not fetch a second copy.
    sent_whole: bool = False


@dataclass
class TicketBook:
    ttl_s: float = DEFAULT_TTL_S
    clock: Callable[[], float] = time.time
    refused: Counter[str] = field(default_factory=Counter)
    _live: OrderedDict[str, Ticket] = field(default_factory=OrderedDict)
    _spent: OrderedDict[str, TicketRefusal] = field(default_factory=OrderedDict)
    # Presented, not finished: may be presented again to resume (until `expires`).
    _open: OrderedDict[str, Ticket] = field(default_factory=OrderedDict)
    resume_ttl_s: float = RESUME_TTL_S

    def issue(self, direction: Direction, node_id: str, node_name: str, task_id: str,
              size: int, header: pb.UpdateHeader | None = None) -> Ticket:
        self._expire()
        if len(self._live) >= MAX_TICKETS:
            old, _ = self._live.popitem(last=False)
            self._remember(old, TicketRefusal.EXPIRED)
        ticket = Ticket(secrets.token_urlsafe(32), direction, node_id, node_name, task_id,
                        size, self.clock() + self.ttl_s, header)
        self._live[ticket.token] = ticket
        return ticket

    def redeem(self, token: str, peer_names: frozenset[str] | None, offset: int = 0) -> Ticket:
        """Spend a ticket; TicketRefused (counted) when it is not a live ticket of this peer.
        `peer_names`: what the connection's client certificate vouches for (None: no mTLS);
        `offset`: where a resumed download continues (0: from the start)."""
        self._expire()
        ticket = self._live.pop(token, None) or self._open.pop(token, None)
        if ticket is not None and ticket.opened and ticket.expires <= self.clock():
            self._remember(token, TicketRefusal.EXPIRED)
            ticket = None
        if ticket is not None and ticket.sent_whole and offset == 0:
            self._open[token] = ticket  # still resumable: only a second whole copy is refused
            ticket = None
        if ticket is None:
            reason = (TicketRefusal.USED if token in self._open
                      else self._spent.get(token, TicketRefusal.UNKNOWN))
            what = {TicketRefusal.USED: "was already used",
                    TicketRefusal.EXPIRED: "expired"}.get(reason, "is not one this aggregator "
                                                                   "issued")
            raise self.refuse(reason, f"bulk ticket {what}: ask for a new one over gRPC")
        if peer_names is not None and ticket.node_name not in peer_names:
            # A stranger's certificate spends the ticket: its node asks for a new one.
            self._remember(token, TicketRefusal.USED)
            shown = ", ".join(sorted(peer_names)) or "no name"
            raise self.refuse(TicketRefusal.WRONG_PEER,
                              f"bulk ticket of node {ticket.node_name!r} presented with a "
                              f"certificate for {shown}")
        ticket.opened = True
        ticket.expires = self.clock() + self.resume_ttl_s
        self._open[token] = ticket
        while len(self._open) > MAX_TICKETS:
            old, _ = self._open.popitem(last=False)
            self._remember(old, TicketRefusal.EXPIRED)
        return ticket

    def finished(self, token: str) -> None:
        """The transfer of `token` completed (or got its verdict): the ticket is spent."""
        if self._open.pop(token, None) is not None:
            self._remember(token, TicketRefusal.USED)

    def sent(self, token: str) -> None:
        """A download's last byte went out: resumable for a while, never sent whole again."""
        ticket = self._open.get(token)
        if ticket is not None:
            ticket.sent_whole = True
            self.broke(token)

    def broke(self, token: str) -> None:
        """The connection of `token` broke off: it may resume within resume_ttl_s from now."""
        ticket = self._open.get(token)
        if ticket is not None:
            ticket.expires = self.clock() + self.resume_ttl_s

    def refuse(self, reason: TicketRefusal, message: str) -> TicketRefused:
        """Count a refusal and return the exception that reports it."""
        self.refused[reason] += 1
        return TicketRefused(reason, message)

    def _remember(self, token: str, why: TicketRefusal) -> None:
        self._spent[token] = why
        while len(self._spent) > MAX_SPENT:
            self._spent.popitem(last=False)

    def _expire(self) -> None:
        now = self.clock()
        # Issued in order with one TTL, so the expired ones are at the front.
        while self._live:
            token, ticket = next(iter(self._live.items()))
            if ticket.expires > now:
                break
            del self._live[token]
            self._remember(token, TicketRefusal.EXPIRED)

    @property
    def outstanding(self) -> int:
        return len(self._live)

    @property
    def resumable(self) -> int:
        """Tickets whose transfer broke or runs and may still be presented to resume it."""
        now = self.clock()
        return sum(1 for t in self._open.values() if t.expires > now)
