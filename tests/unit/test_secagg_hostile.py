"""An aggregator that bends the protocol, against the site's real code.

Threat model: the aggregator follows the wire format but chooses what it sends to each site
(thresholds, survivor lists, a second run of a round). The site code under test is the real
one: fedgpu/core/secagg/site.py, and node/secagg.py's `take_part`, the node's protocol loop,
talking to a fake aggregator through the same push/pull calls as node/wire_client.py's
WireClient. The fake aggregator is the real AggregatorSession driven by hand, with the other
sites of the round played in-process by real SiteSessions. Each test is one attack:

- differencing across attempts: a second run of one round (the same global model) after its
  sum was unmasked: the site refuses, and still refuses after a restart;
- an attempt retried before unmasking still completes (nothing was revealed);
- a lowered threshold (t = 2 of 5 shareholders) with split survivor views: refused at setup;
  with the strict majority the site demands, split views rebuild only one of a site's secrets;
- a replayed unmask request within an attempt: refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from fedgpu.core import codec
from fedgpu.core.secagg import shamir
from fedgpu.core.secagg.aggregator import AggregatorSession, Outcome
from fedgpu.core.secagg.errors import SecAggError, Stage
from fedgpu.core.secagg.identity import SiteIdentity
from fedgpu.core.secagg.messages import (
    KeyRelay,
    MaskedInput,
    PublicKeys,
    Setup,
    ShareKeys,
    ShareKind,
    UnmaskReply,
    UnmaskRequest,
    ViewSignature,
)
from fedgpu.core.secagg.params import RoundParams, Settings, majority_problem
from fedgpu.core.secagg.site import SiteSession
from fedgpu.node.secagg import KIND_OF, Link, take_part
from fedgpu.node.unmask_ledger import FILE_NAME, UnmaskLedger
from fedgpu.proto import pb

LENGTH = 64
STAGE_OF = {v: k for k, v in KIND_OF.items()}


@dataclass
class _Pulled:
    """What WireClient.pull returns (node/wire_client.py Pulled), for the fields used."""

    header: pb.TaskHeader
    payload: memoryview | None
    receiver: None = None


class FakeAggregator:
    """The aggregator of one attempt, on the node's wire calls: site 1 is the node under
    test, sites 2..n answer in-process as soon as site 1 has. `stop_before` ends the attempt
    (the node is told nothing more) before that stage's relay."""

    def __init__(self, n: int = 3, stop_before: Stage | None = None,
                 identities: Sequence[SiteIdentity] = (),
                 tamper: Callable[[dict[int, KeyRelay]], dict[int, KeyRelay]] | None = None,
                 metrics: bool = False) -> None:
        """`identities`: the sites' TLS identities (a signed round); `tamper`: what the
        aggregator does to the key relays before site 1's goes out; `metrics`: the round
        carries the sites' numbers masked (fedgpu/core/secagg/masked_metrics.py)."""
        roster = tuple(i.name for i in identities)
        self.agg = AggregatorSession(Settings().resolve(n, LENGTH, metrics=metrics),
                                     roster=roster)
        setups = self.agg.start()
        self.setup = setups[1].encode()
        rng = np.random.default_rng(1)
        self.others = {i: SiteSession(setups[i], identity=identities[i - 1] if identities
                                      else None) for i in range(2, n + 1)}
        self.tamper = tamper
        self.changes = {i: rng.uniform(-0.5, 0.5, LENGTH).astype(np.float32)
                        for i in range(1, n + 1)}
        self.stop_before = stop_before
        self.relays: asyncio.Queue[_Pulled] = asyncio.Queue()
        self.pushed: list[pb.UpdateHeader] = []
        self.outcome: Outcome | None = None
        self.abandoned = False

    def task(self, digest: str = "ab" * 32, job: str = "") -> pb.TaskHeader:
        header = pb.TaskHeader(task_id="t-1", round=1, kind=pb.TASK_KIND_TRAIN,
                               secagg_setup=self.setup, payload_digest=digest,
                               payload_digest_algorithm=pb.DIGEST_ALGORITHM_SHA256)
        if job:
            header.job_terms.job_id = job
        return header

    def _relay(self, stage: Stage, msg: object) -> None:
        if stage == self.stop_before:
            self.abandoned = True
            return
        data = msg.encode()  # type: ignore[attr-defined]
        self.relays.put_nowait(_Pulled(pb.TaskHeader(task_id="t-1", round=1,
                                                     kind=KIND_OF[stage]), memoryview(data)))

    async def push(self, header: pb.UpdateHeader, source: codec.Encoded | None
                   ) -> tuple[pb.PushReply, str]:
        copy = pb.UpdateHeader()
        copy.CopyFrom(header)
        self.pushed.append(copy)
        if header.failed:
            return pb.PushReply(), "grpc"
        assert source is not None
        data = source.to_bytes()
        agg, stage = self.agg, STAGE_OF[header.kind]
        if stage == Stage.ADVERTISE_KEYS:
            agg.receive_keys(PublicKeys.decode(data))
            for s in self.others.values():
                agg.receive_keys(s.advertise())
            relays = agg.close_keys()
            for i, s in self.others.items():
                agg.receive_shares(s.share_keys(relays[i]))
            # Only the node under test gets the tampered relay.
            self._relay(Stage.SHARE_KEYS, (self.tamper(relays) if self.tamper else relays)[1])
        elif stage == Stage.SHARE_KEYS:
            agg.receive_shares(ShareKeys.decode(data))
            relays = agg.close_shares()
            for i, s in self.others.items():
                agg.receive_masked(s.masked_input(relays[i], self.changes[i], 10.0))
            self._relay(Stage.MASKED_INPUT, relays[1])
        elif stage == Stage.MASKED_INPUT:
            agg.receive_masked(MaskedInput.decode(data))
            out = agg.close_masked()
            if agg.signed:
                for i, s in self.others.items():
                    agg.receive_view(s.consistency(out[i]))  # type: ignore[arg-type]
                self._relay(Stage.CONSISTENCY, out[1])
            else:
                self._unmask(out)  # type: ignore[arg-type]
        elif stage == Stage.CONSISTENCY:
            agg.receive_view(ViewSignature.decode(data))
            self._unmask(agg.close_consistency())
        else:
            agg.receive_unmask(UnmaskReply.decode(data))
            self.outcome = agg.finish()
        return pb.PushReply(), "grpc"

    def _unmask(self, requests: dict[int, UnmaskRequest]) -> None:
        for i, s in self.others.items():
            self.agg.receive_unmask(s.unmask(requests[i]))
        self._relay(Stage.UNMASK, requests[1])

    async def pull(self, node_id: str, wait_s: int, max_bytes: int, only: str = "") -> _Pulled:
        # `only`: the site asks for its round's next stage only (a site with --slots).
        assert only, "a secure round's stage is pulled by its task id"
        try:
            return await asyncio.wait_for(self.relays.get(), 0.2)
        except TimeoutError:
            return _Pulled(pb.TaskHeader(kind=pb.TASK_KIND_NONE), None)


def _attempt(fake: FakeAggregator, ledger: UnmaskLedger, digest: str = "ab" * 32,
             identity: SiteIdentity | None = None, job: str = "") -> str | None:
    link = Link(fake, "node-1", 1, 1 << 20, lambda: fake.abandoned,  # type: ignore[arg-type]
                ledger, identity=identity)
    update = pb.UpdateHeader(num_examples=10)
    return asyncio.run(asyncio.wait_for(
        take_part(link, fake.task(digest, job), update, fake.changes[1], 10.0), 30))


# ---- differencing across attempts -----------------------------------------------------------

def test_a_second_run_of_an_unmasked_round_is_refused_even_after_a_restart(
        tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    first = FakeAggregator()
    assert _attempt(first, UnmaskLedger(path)) is None
    assert first.outcome is not None and first.outcome.report.masked == 3
    # The aggregator runs the round again on the same model (a retry after unmasking, or a
    # replayed model), this time without another site: sum(1, 2, 3) - sum(1, 2) would be
    # site 3's update. The site in question answers nothing, up front, with the reason...
    for ledger in (UnmaskLedger(path), UnmaskLedger(path)):  # ...also after a restart
        again = FakeAggregator()
        why = _attempt(again, ledger)
        assert why is not None and "already answered an unmask request for round 1" in why
        assert again.outcome is None
        (failed,) = again.pushed
        assert failed.failed and "trained from this same model" in failed.error
    # A round trained from another model (the next round) is answered as usual.
    assert _attempt(FakeAggregator(), UnmaskLedger(path), digest="cd" * 32) is None


def test_a_round_of_a_named_job_is_unmasked_once_whatever_model_it_sends(
        tmp_path: Path) -> None:
    """The aggregator re-runs round 1 of job j-1 with a slightly different model (another
    digest): the site that already answered round 1 of j-1 refuses, also after a restart; the
    same model in another job is refused by its digest, and round 1 of another job with
    another model is answered."""
    path = tmp_path / FILE_NAME
    assert _attempt(FakeAggregator(), UnmaskLedger(path), job="j-1") is None
    for ledger in (UnmaskLedger(path), UnmaskLedger(path)):
        again = FakeAggregator()
        why = _attempt(again, ledger, digest="ef" * 32, job="j-1")
        assert why is not None and "round 1 of job j-1" in why and again.outcome is None
    why = _attempt(FakeAggregator(), UnmaskLedger(path), job="j-2")
    assert why is not None and "trained from this same model" in why
    assert _attempt(FakeAggregator(), UnmaskLedger(path), digest="ef" * 32, job="j-2") is None


def test_an_attempt_retried_before_unmasking_still_completes(tmp_path: Path) -> None:
    ledger = UnmaskLedger(tmp_path / FILE_NAME)
    # Attempt 1 ends before any unmask request (too few masked inputs): nothing revealed.
    first = FakeAggregator(stop_before=Stage.UNMASK)
    why = _attempt(first, ledger)
    assert why is not None and "ended at unmask" in why and first.outcome is None
    # The retry, on the same model, completes: this site's sum is unmasked once.
    second = FakeAggregator()
    assert _attempt(second, ledger) is None
    assert second.outcome is not None and second.outcome.report.masked == 3


def test_the_ledger_reads_back_past_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    UnmaskLedger(path).record("sha256:aa", 4)
    with open(path, "a") as fh:
        fh.write('{"digest": "sha256:b')  # a crash mid-write: its reply never left
    back = UnmaskLedger(path)
    assert back.problem("sha256:aa") is not None and back.problem("sha256:bb") is None


# ---- a lowered threshold and split survivor views --------------------------------------------

def _setup(n: int, threshold: int, index: int = 1) -> Setup:
    params = RoundParams(n_sites=n, degree=n - 1, threshold=threshold, clip=1.0, bits=16,
                         ring_bits=64, max_weight=64, stochastic=True, length=LENGTH)
    return Setup(b"c" * 32, index, b"g" * 32, params)


def test_a_threshold_below_a_strict_majority_is_refused_at_setup() -> None:
    # t = 2 of 5 shareholders passes the old range check (2 <= t <= k + 1) ...
    _setup(5, 2).params.check()
    # ... but two pairs of sites shown different survivor lists would each reach it.
    with pytest.raises(SecAggError, match="setup refused: threshold 2 is not a strict majority "
                                          "of the 5 shareholders.*at least 3 is needed"):
        SiteSession(Setup.decode(_setup(5, 2).encode()))
    SiteSession(_setup(5, 3))
    # The site's own floor (--secagg-min-threshold) on top of the majority.
    with pytest.raises(SecAggError, match="below this site's minimum of 4"):
        SiteSession(_setup(5, 3), min_threshold=4)
    assert majority_problem(4, 4, 4) is None and majority_problem(2, 2) is None


def test_the_node_reports_a_refused_setup_with_its_reason(tmp_path: Path) -> None:
    fake = FakeAggregator()
    fake.setup = _setup(5, 2).encode()
    why = _attempt(fake, UnmaskLedger(tmp_path / FILE_NAME))
    assert why is not None and "not a strict majority" in why
    (failed,) = fake.pushed
    assert failed.failed and "setup refused" in failed.error


def test_split_survivor_views_rebuild_only_one_secret_under_a_majority() -> None:
    # Five sites, threshold 3 (the least a site accepts). The aggregator tells sites 2 and 3
    # that site 1 survived (asking for its self-mask share) and sites 4 and 5 that it dropped
    # (asking for its mask-key share); site 1 itself hands over its own self-mask share.
    agg = AggregatorSession(Settings().resolve(5, LENGTH))
    sites = {i: SiteSession(s) for i, s in agg.start().items()}
    assert agg.params.threshold == 3
    for s in sites.values():
        agg.receive_keys(s.advertise())
    keys = agg.close_keys()
    for i, s in sites.items():
        agg.receive_shares(s.share_keys(keys[i]))
    shares = agg.close_shares()
    rng = np.random.default_rng(0)
    for i, s in sites.items():
        s.masked_input(shares[i], rng.uniform(-1, 1, LENGTH).astype(np.float32), 1.0)
    everyone = (1, 2, 3, 4, 5)
    told = {1: UnmaskRequest((), everyone), 2: UnmaskRequest((), everyone),
            3: UnmaskRequest((), everyone), 4: UnmaskRequest((1,), (2, 3, 4, 5)),
            5: UnmaskRequest((1,), (2, 3, 4, 5))}
    got: dict[ShareKind, list[shamir.Share]] = {ShareKind.SELF_MASK: [],
                                                 ShareKind.MASK_KEY: []}
    for i, s in sites.items():
        for r in s.unmask(told[i]).shares:
            if r.owner == 1:
                got[r.kind].append(shamir.share_from_bytes(i, r.y))
    assert len(got[ShareKind.SELF_MASK]) == 3 and len(got[ShareKind.MASK_KEY]) == 2
    # The self-mask seed comes out (as it would for any counted site), but two mask-key
    # shares are below the threshold: they interpolate to some other field element, not site
    # 1's mask key, so its pairwise masks stay on its input.
    assert shamir.combine(got[ShareKind.SELF_MASK]) == sites[1]._b
    secret = int.from_bytes(sites[1]._s.secret, "big")
    assert shamir.combine_int(got[ShareKind.MASK_KEY]) != secret


def test_a_replayed_unmask_request_is_refused() -> None:
    agg = AggregatorSession(Settings().resolve(3, LENGTH))
    sites = {i: SiteSession(s) for i, s in agg.start().items()}
    for s in sites.values():
        agg.receive_keys(s.advertise())
    keys = agg.close_keys()
    for i, s in sites.items():
        agg.receive_shares(s.share_keys(keys[i]))
    shares = agg.close_shares()
    for i, s in sites.items():
        agg.receive_masked(s.masked_input(shares[i], np.zeros(LENGTH, np.float32), 1.0))
    requests = agg.close_masked()
    sites[1].unmask(requests[1])
    # The same request again, or one that now says site 2 dropped: no second answer.
    for replay in (requests[1], UnmaskRequest((2,), (1, 3))):
        with pytest.raises(SecAggError, match="unmasking out of order"):
            sites[1].unmask(replay)
