"""Secure aggregation against an active aggregator, when sites have identities (mutual TLS).

Threat model: the aggregator bends the protocol. It may relay public keys it made itself
(then it could rebuild a site's pairwise masks), keys a site signed for another round, keys
certified by another CA or for the aggregator itself, and it may show different survivors to
different sites. Each site signs its keys and the survivor set it was shown with its TLS key
(fedgpu/core/secagg/identity.py) and checks its neighbours'; every one of these attacks aborts
the round at the site, with the reason. The certificates are real ones from `fedgpu certs`'
code (a CA, node certificates, the aggregator's); the sites are the real SiteSession; the
aggregator is the real AggregatorSession driven by hand, with the messages it relays altered.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fedgpu.core import certs
from fedgpu.core.secagg.aggregator import AggregatorSession
from fedgpu.core.secagg.errors import SecAggError, Stage
from fedgpu.core.secagg.identity import SiteIdentity
from fedgpu.core.secagg.messages import (
    KeyRelay,
    PublicKeys,
    Setup,
    SurvivorView,
    UnmaskRequest,
)
from fedgpu.core.secagg.params import Settings
from fedgpu.core.secagg.site import SiteSession
from fedgpu.node.secagg import KIND_OF
from fedgpu.node.unmask_ledger import UnmaskLedger
from tests.unit.test_secagg_hostile import FakeAggregator, _attempt

LENGTH = 32
NAMES = ("site-a", "site-b", "site-c", "site-d", "site-e")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SiteIdentity]:
    """Identities of five sites, of the aggregator, and of a site of another federation."""
    root = tmp_path_factory.mktemp("pki")
    ca = root / "ca"
    certs.init_ca(ca)
    out = {}
    for name in NAMES:
        i = certs.issue_node(ca, name)
        out[name] = SiteIdentity.from_files(i.cert, i.key, i.ca)
    s = certs.issue_server(ca, "aggregator")
    out["aggregator"] = SiteIdentity.from_files(s.cert, s.key, s.ca)
    other = root / "other-ca"
    certs.init_ca(other)
    o = certs.issue_node(other, "site-b")
    out["outsider"] = SiteIdentity.from_files(o.cert, o.key, o.ca)
    return out


def _round(pki: dict[str, SiteIdentity], n: int = 5
           ) -> tuple[AggregatorSession, dict[int, SiteSession]]:
    agg = AggregatorSession(Settings().resolve(n, LENGTH), roster=NAMES[:n])
    sites = {i: SiteSession(s, identity=pki[NAMES[i - 1]]) for i, s in agg.start().items()}
    for s in sites.values():
        agg.receive_keys(s.advertise())
    return agg, sites


def _to_masked(agg: AggregatorSession, sites: dict[int, SiteSession],
               relays: dict[int, KeyRelay] | None = None) -> None:
    relays = relays or agg.close_keys()
    for i, s in sites.items():
        agg.receive_shares(s.share_keys(relays[i]))
    shares = agg.close_shares()
    rng = np.random.default_rng(0)
    for i, s in sites.items():
        agg.receive_masked(s.masked_input(shares[i], rng.uniform(-1, 1, LENGTH)
                                          .astype(np.float32), 2.0))


def test_a_signed_round_runs_the_consistency_check_and_unmasks(
        pki: dict[str, SiteIdentity]) -> None:
    agg, sites = _round(pki)
    _to_masked(agg, sites)
    assert agg.signed
    views = agg.close_masked()
    assert agg.stage == Stage.CONSISTENCY and set(views) == set(sites)
    for i, s in sites.items():
        agg.receive_view(s.consistency(views[i]))  # type: ignore[arg-type]
    requests = agg.close_consistency()
    for i, s in sites.items():
        agg.receive_unmask(s.unmask(requests[i]))
    out = agg.finish()
    assert out.report.masked == 5 and out.total_weight == 10


def _relay_with(relays: dict[int, KeyRelay], victim: int, forged: PublicKeys
                ) -> dict[int, KeyRelay]:
    return {i: KeyRelay(tuple(forged if p.index == victim else p for p in r.peers))
            for i, r in relays.items()}


def test_a_key_the_aggregator_made_aborts_the_round(pki: dict[str, SiteIdentity]) -> None:
    agg, sites = _round(pki)
    relays = agg.close_keys()
    real = next(p for p in relays[1].peers if p.index == 2)
    mine = AggregatorSession(agg.params).start()[2]  # a fresh site 2 of its own making
    made = SiteSession(mine).advertise()
    for forged, why in (
        # Its own keys under site 2's certificate and signature: the signature does not match.
        (replace(real, c_public=made.c_public, s_public=made.s_public),
         "do not carry its signature for this round: forged"),
        # No certificate at all.
        (made, "no certificate"),
        # Signed with the aggregator's own TLS key: a certificate, but not a node's.
        (replace(made, cert=pki["aggregator"].cert_der, signature=b"x"), "not a node's"),
        # A node certificate for the same name from another CA.
        (replace(made, cert=pki["outsider"].cert_der, signature=b"x"),
         "not issued by this federation's CA"),
        # Site 3's genuine certificate at site 2's index.
        (replace(real, cert=pki["site-c"].cert_der), "is 'site-c''s"),
    ):
        site = SiteSession(agg.setup(1), identity=pki["site-a"])
        site.advertise()
        with pytest.raises(SecAggError, match=f"site 1: aborted: the keys of site 2 "
                                              f"\\(site-b\\):? .*{why}"):
            site.share_keys(_relay_with(relays, 2, forged)[1])


def test_a_key_relayed_from_another_round_aborts_the_round(
        pki: dict[str, SiteIdentity]) -> None:
    old, _ = _round(pki)
    old_keys = old.close_keys()
    replayed = next(p for p in old_keys[1].peers if p.index == 2)
    agg, sites = _round(pki)
    relays = _relay_with(agg.close_keys(), 2, replayed)
    with pytest.raises(SecAggError, match="keys of site 2 \\(site-b\\) do not carry its "
                                          "signature for this round: forged, or relayed"):
        sites[1].share_keys(relays[1])


def test_unsigned_keys_or_an_unsigned_setup_are_refused(pki: dict[str, SiteIdentity]) -> None:
    agg = AggregatorSession(Settings().resolve(3, LENGTH))  # no roster: an unsigned round
    with pytest.raises(SecAggError, match="setup refused: it does not name this site"):
        SiteSession(agg.start()[1], identity=pki["site-a"])
    # A neighbour that advertises without signing (no identity) is refused by one that has.
    agg = AggregatorSession(Settings().resolve(3, LENGTH), roster=NAMES[:3])
    setups = agg.start()
    signed = SiteSession(setups[1], identity=pki["site-a"])
    agg.receive_keys(signed.advertise())
    for i in (2, 3):
        agg.receive_keys(SiteSession(setups[i]).advertise())
    with pytest.raises(SecAggError, match="keys of site 2 \\(site-b\\): no certificate"):
        signed.share_keys(agg.close_keys()[1])


def test_disagreeing_survivor_sets_abort_before_any_share_is_revealed(
        pki: dict[str, SiteIdentity]) -> None:
    agg, sites = _round(pki)
    _to_masked(agg, sites)
    agg.close_masked()
    # The aggregator tells sites 1-3 that everyone survived, sites 4 and 5 that site 1 did
    # not: with both stories it would get self-mask shares of site 1 from the first group
    # and mask-key shares from the second.
    everyone, without = SurvivorView((1, 2, 3, 4, 5)), SurvivorView((2, 3, 4, 5))
    sigs = {i: sites[i].consistency(everyone if i <= 3 else without) for i in sites}
    for i in (2, 3):  # both groups' requests carry every signature it got
        request = UnmaskRequest((), everyone.survivors, tuple(sigs[j] for j in sites if j != i))
        with pytest.raises(SecAggError, match=f"site {i}: aborted: site 4 signed another set "
                                              "of survivors"):
            sites[i].unmask(request)
    # Withholding the disagreeing signatures instead: sites 4 and 5 find only two signatures
    # of their set (their own included), below the threshold of 3.
    request = UnmaskRequest((1,), (2, 3, 4, 5), (sigs[5],))
    with pytest.raises(SecAggError, match="site 4: aborted: 2 sites signed the survivor set, "
                                          "threshold 3"):
        sites[4].unmask(request)


def test_an_unmask_request_that_disagrees_with_the_signed_view_or_skips_it_is_refused(
        pki: dict[str, SiteIdentity]) -> None:
    agg, sites = _round(pki)
    _to_masked(agg, sites)
    views = agg.close_masked()
    sigs = {i: s.consistency(views[i]) for i, s in sites.items()}  # type: ignore[arg-type]
    others = tuple(sigs[j] for j in (2, 3, 4, 5))
    # Signed "everyone survived", then asked for site 2's mask key as if it had dropped.
    with pytest.raises(SecAggError, match="disagrees with the survivor set it signed"):
        sites[1].unmask(UnmaskRequest((2,), (1, 3, 4, 5), others))
    # An aggregator that skips the consistency check gets no answer either.
    agg2, sites2 = _round(pki, 3)
    _to_masked(agg2, sites2)
    agg2.close_masked()
    with pytest.raises(SecAggError, match="unmasking out of order"):
        sites2[1].unmask(UnmaskRequest((), (1, 2, 3)))


def test_setup_roster_round_trips_and_is_checked() -> None:
    agg = AggregatorSession(Settings().resolve(3, LENGTH), roster=NAMES[:3])
    setup = agg.start()[2]
    assert Setup.decode(setup.encode()).roster == NAMES[:3]
    with pytest.raises(SecAggError, match="roster must name every site once"):
        Setup.decode(replace(setup, roster=("a", "a", "b")).encode())


# ---- the node's protocol loop (node/secagg.py) against a fake aggregator ----------------------

def test_the_node_completes_a_signed_round(pki: dict[str, SiteIdentity], tmp_path: Path
                                           ) -> None:
    ids = [pki[n] for n in NAMES[:3]]
    fake = FakeAggregator(identities=ids)
    assert _attempt(fake, UnmaskLedger(tmp_path / "l"), identity=ids[0]) is None
    assert fake.outcome is not None and fake.outcome.report.masked == 3
    kinds = [h.kind for h in fake.pushed]
    assert KIND_OF[Stage.CONSISTENCY] in kinds  # the node signed its survivor set


def test_the_node_aborts_on_a_forged_key_and_says_why(pki: dict[str, SiteIdentity],
                                                      tmp_path: Path) -> None:
    ids = [pki[n] for n in NAMES[:3]]

    def forge(relays: dict[int, KeyRelay]) -> dict[int, KeyRelay]:
        made = SiteSession(AggregatorSession(Settings().resolve(3, LENGTH)).start()[2])
        keys = made.advertise()
        return _relay_with(relays, 2, replace(next(p for p in relays[1].peers
                                                     if p.index == 2),
                                                c_public=keys.c_public,
                                                s_public=keys.s_public))

    fake = FakeAggregator(identities=ids, tamper=forge)
    why = _attempt(fake, UnmaskLedger(tmp_path / "l"), identity=ids[0])
    assert why is not None and "aborted: the keys of site 2 (site-b) do not carry" in why
    # The reason goes to the aggregator as the site's failure (`fedgpu rounds` lists it).
    failed = fake.pushed[-1]
    assert failed.failed and failed.kind == KIND_OF[Stage.SHARE_KEYS]
    assert "forged, or relayed from another round" in failed.error
    assert fake.outcome is None


def test_the_node_refuses_an_unmask_request_that_skips_the_consistency_check(
        pki: dict[str, SiteIdentity], tmp_path: Path) -> None:
    ids = [pki[n] for n in NAMES[:3]]

    class Skipping(FakeAggregator):
        """Sends the unmask requests straight after the masked inputs."""

        def _relay(self, stage: Stage, msg: object) -> None:
            if stage == Stage.CONSISTENCY:
                self.agg.close_consistency()  # with the other sites' signatures only
                stage, msg = Stage.UNMASK, self.agg._requests.get(1, UnmaskRequest((), ()))
            super()._relay(stage, msg)

    fake = Skipping(identities=ids)
    why = _attempt(fake, UnmaskLedger(tmp_path / "l"), identity=ids[0])
    assert why is not None and "without the consistency check" in why
    assert fake.pushed[-1].failed and fake.outcome is None
