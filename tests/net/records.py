"""What the network scenarios read back: round records from the aggregator, bytes from the
links, trainings from the sites' logs; and the checks every scenario makes with them."""

from __future__ import annotations

import time
from typing import Any

from tests.net.net_federation import NetFederation
from tests.net.wan_link import Carried, Way

# Bytes re-sent beyond the payload, at most (issue 37's target).
RESEND_SHARE = 0.05
# A bulk connection's hello, ticket and status frames beside the payload.
FRAMING = 1024


def rounds(fed: NetFederation) -> list[dict[str, Any]]:
    return list(fed.query("ListRounds")["rounds"])


def wait_for(cond: Any, timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if got := cond():
            return got
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def finished(fed: NetFederation, number: int, timeout: float = 90) -> dict[str, Any]:
    """Round `number`'s finished record (its last attempt)."""
    def done() -> dict[str, Any] | None:
        recs = [r for r in rounds(fed) if r["round"] == number and r["status"] == "finished"]
        return recs[-1] if recs else None
    return wait_for(done, timeout, f"round {number} to finish")  # type: ignore[no-any-return]


def attempt_at(fed: NetFederation, when: float, timeout: float = 90) -> tuple[int, int]:
    """(round, attempt) that was running at time.time() `when`, once it has closed (the
    aggregator lists an attempt when it closes)."""
    def covering() -> list[dict[str, Any]]:
        # No slack at the end: a transfer of the next round can start within milliseconds
        # of the last one's close, and must not be taken for it.
        return [r for r in rounds(fed)
                if r["started_at"] <= when <= r["started_at"] + r["duration_s"]]
    recs = wait_for(covering, timeout, f"the round running at {when}")
    last = max(recs, key=lambda r: r["started_at"])
    return int(last["round"]), int(last["attempt"])


def all_sites_in_a_round(fed: NetFederation, timeout: float = 90) -> dict[str, Any]:
    """A round that started from now on with every site's update: the federation is whole
    again (after a restart, sites register anew on their own backoff, up to ~12 s)."""
    since = time.time()
    names = {f"site-{i + 1}" for i in range(len(fed.links))}
    def whole() -> dict[str, Any] | None:
        return next((r for r in rounds(fed) if r["status"] == "finished"
                     and r["started_at"] > since
                     and {u["node"] for u in r["updates"]} == names), None)
    return wait_for(whole, timeout, "a round with every site")  # type: ignore[no-any-return]


def node_of(node_id: str) -> str:
    """'site-1-8702a0d5' -> 'site-1' (a site registering again gets a new id, same name)."""
    return node_id.rsplit("-", 1)[0]


def payload(fed: NetFederation, way: Way) -> int:
    """Bytes of one whole, uncut transfer of the model `way` on the bulk port, framing
    included (the digits model: ~154 kB), from a transfer that was never cut."""
    sizes = [c.delivered[way] for link in fed.links for c in link.transfers("bulk")
             if not c.cut and c.closed and c.bytes[way] > 64 << 10]
    assert sizes, "no whole transfer seen yet"
    return max(sizes)


def resent(link_history: list[Carried], way: Way, whole: int) -> tuple[int, int]:
    """Bytes of `way` that crossed twice for the transfer a cut broke: the cut connection and
    the next one of the same port (its resume) together, less one whole transfer, as
    (delivered twice, sent twice). Delivered: what the receiver got twice, which a resume
    decides. Sent: also counts what was in flight inside the link when it was cut (lost with
    the connection: up to a bandwidth-delay product, 1.25 MB at 50 Mbit/s and 200 ms, more than
    this whole small payload), which any protocol sends again."""
    index = max(i for i, c in enumerate(link_history) if c.cut)  # the latest cut
    resume = next((c for c in link_history[index + 1:] if c.bytes[way] > 0), None)
    assert resume is not None, ("the broken transfer was never resumed",
                                link_history[max(0, index - 3):])
    cut = link_history[index]
    return (cut.delivered[way] + resume.delivered[way] - whole,
            cut.bytes[way] + resume.bytes[way] - whole)


def assert_counted_once(fed: NetFederation) -> None:
    """No update counted twice in any finished round, and no site trained a round more
    often than it was asked to (once per attempt it took part in)."""
    recs = rounds(fed)
    for r in recs:
        names = [u["node"] for u in r["updates"]]
        assert len(names) == len(set(names)), f"round {r['round']} counted a site twice: {r}"
    for i in range(len(fed.links)):
        name = f"site-{i + 1}"
        trained = fed.trained(i)
        for number in set(trained):
            asked = sum(1 for r in recs if r["round"] == number
                        and any(node_of(p) == name for p in r["participants"]))
            # A round still open may not be listed as attempted yet: one training allowed.
            asked = max(asked, 1)
            assert trained.count(number) <= asked, (
                f"{name} trained round {number} {trained.count(number)} times for {asked} "
                f"attempt(s)")
