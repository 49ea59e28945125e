"""A site's side of one secure-aggregation round, as a state machine without I/O.

    session = SiteSession(setup)                   # fresh keys and self-mask seed
    keys = session.advertise()                     # -> aggregator
    shares = session.share_keys(key_relay)         # -> aggregator
    masked = session.masked_input(share_relay, update, weight)  # -> aggregator
    signed = session.consistency(survivor_view)    # -> aggregator (sites with an identity)
    reply = session.unmask(unmask_request)         # -> aggregator

Every step checks what the aggregator sent against what this site can verify (its neighbours,
the threshold, the stage) and raises SecAggError instead of answering a request that would
leak: above all, it never reveals both a share of a site's self-mask seed and a share of the
same site's mask key (the double-masking rule), and it answers one unmask request per round.
It takes a threshold only when it is a strict majority of its shareholders. With a TLS
identity (fedgpu/core/secagg/identity.py) it signs its keys and the survivor set it is shown,
and aborts on a neighbour's key or survivor set that does not carry that neighbour's signature.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
from cryptography import x509

from fedgpu.core.secagg import crypto, graph, masked_metrics, shamir
from fedgpu.core.secagg.errors import BelowThreshold, SecAggError, Stage
from fedgpu.core.secagg.identity import SiteIdentity, keys_statement, verify, view_statement
from fedgpu.core.secagg.messages import (
    KeyRelay,
    MaskedInput,
    PublicKeys,
    RevealedShare,
    Sealed,
    Setup,
    ShareKeys,
    ShareKind,
    ShareRelay,
    SurvivorView,
    UnmaskReply,
    UnmaskRequest,
    ViewSignature,
)
from fedgpu.core.secagg.noise_share import NoiseShare, ShareReport, Spans, add_share
from fedgpu.core.secagg.params import majority_problem
from fedgpu.core.secagg.prg import SEED_BYTES, apply_masks, ring_dtype
from fedgpu.core.secagg.quantize import encode, site_weight


class SiteSession:
    def __init__(self, setup: Setup, rng: np.random.Generator | None = None,
                 min_threshold: int = 0, identity: SiteIdentity | None = None) -> None:
        """`min_threshold`: the site's own floor on the threshold, on top of the strict
        majority of its shareholders it always demands (params.majority_problem).
        `identity`: the site's TLS identity; with one, the site signs its keys and its view
        of the survivors, and takes part only in rounds where every neighbour does too."""
        setup.params.check()
        # The threshold comes from the aggregator: taken only when no split view of who
        # survived could hand the aggregator both secrets of one site.
        why = majority_problem(setup.params.threshold, setup.params.degree, min_threshold)
        if why is not None:
            raise SecAggError(f"site {setup.index}: setup refused: {why}")
        if identity is not None and (not setup.roster
                                     or setup.roster[setup.index - 1] != identity.name):
            # Without the roster the neighbours' certificates cannot be matched to indices.
            raise SecAggError(f"site {setup.index}: setup refused: it does not name this "
                              f"site ({identity.name}) in a roster of the round's sites")
        self.identity = identity
        self._certs: dict[int, x509.Certificate] = {}
        self._view: tuple[int, ...] | None = None
        self.setup = setup
        self.me = setup.index
        self.params = setup.params
        # The graph is derived here, not taken from the aggregator: a site only ever shares
        # with, and masks against, the neighbours the shared seed gives it.
        self.neighbours = graph.neighbours(self.params.n_sites, self.params.degree,
                                           setup.graph_seed)[self.me]
        self._c = crypto.KeyPair.generate()
        self._s = crypto.KeyPair.generate()
        self._b = os.urandom(SEED_BYTES)
        self._rng = rng if rng is not None else np.random.default_rng()
        self._peers: dict[int, PublicKeys] = {}
        # The shares this site holds: owner -> (share of b, share of s_sk).
        self._held: dict[int, tuple[shamir.Share, shamir.Share]] = {}
        # Distributed DP: what this site's noise share was (its own metrics, never sent raw).
        self.noise_report: ShareReport | None = None
        self.stage = Stage.SETUP

    def _expect(self, stage: Stage, step: str) -> None:
        if self.stage != stage:
            raise SecAggError(f"site {self.me}: {step} out of order (after {self.stage})")

    def advertise(self) -> PublicKeys:
        self._expect(Stage.SETUP, "advertising keys")
        self.stage = Stage.ADVERTISE_KEYS
        if self.identity is None:
            return PublicKeys(self.me, self._c.public, self._s.public)
        statement = keys_statement(self.setup.context, self.me, self._c.public, self._s.public)
        return PublicKeys(self.me, self._c.public, self._s.public, self.identity.cert_der,
                          self.identity.sign(statement))

    def _check_signed(self, p: PublicKeys) -> None:
        """A neighbour's keys, signed by the site the roster names at its index for this
        round; SecAggError (the round is aborted) for a forged or replayed key."""
        assert self.identity is not None
        name = self.setup.roster[p.index - 1]
        try:
            cert = self.identity.check_peer(p.cert, name)
        except SecAggError as exc:
            raise SecAggError(f"site {self.me}: aborted: the keys of site {p.index} "
                              f"({name}): {exc}") from None
        statement = keys_statement(self.setup.context, p.index, p.c_public, p.s_public)
        if not verify(cert, p.signature, statement):
            raise SecAggError(f"site {self.me}: aborted: the keys of site {p.index} ({name}) "
                              "do not carry its signature for this round: forged, or "
                              "relayed from another round")
        self._certs[p.index] = cert

    def share_keys(self, relay: KeyRelay) -> ShareKeys:
        self._expect(Stage.ADVERTISE_KEYS, "sharing keys")
        for p in relay.peers:
            if p.index not in self.neighbours:
                raise SecAggError(f"site {self.me}: keys of site {p.index}, not a neighbour")
            if p.index in self._peers:
                raise SecAggError(f"site {self.me}: keys of site {p.index} relayed twice")
            if self.identity is not None:
                self._check_signed(p)
            self._peers[p.index] = p
        holders = sorted([*self._peers, self.me])
        t = self.params.threshold
        if len(holders) < t:
            raise BelowThreshold(Stage.ADVERTISE_KEYS, len(holders), t, "shareholders")
        b_shares = shamir.split(self._b, t, holders)
        sk_shares = shamir.split(self._s.secret, t, holders)
        ctx = self.setup.context
        sealed = []
        for b_share, sk_share in zip(b_shares, sk_shares, strict=True):
            holder = b_share.x
            if holder == self.me:
                self._held[self.me] = (b_share, sk_share)
                continue
            key = crypto.share_key(self._c, self._peers[holder].c_public, ctx,
                                   self.me, holder)
            plain = (self.me.to_bytes(4, "big") + holder.to_bytes(4, "big")
                     + b_share.y_bytes() + sk_share.y_bytes())
            sealed.append(Sealed(holder, crypto.seal(key, plain, ctx, self.me, holder)))
        self.stage = Stage.SHARE_KEYS
        return ShareKeys(self.me, tuple(sealed))

    def _open(self, item: Sealed) -> tuple[shamir.Share, shamir.Share]:
        src = item.peer
        if src not in self._peers:
            raise SecAggError(f"site {self.me}: shares from site {src}, whose keys it never got")
        key = crypto.share_key(self._c, self._peers[src].c_public, self.setup.context,
                               self.me, src)
        plain = crypto.open_sealed(key, item.data, self.setup.context, src, self.me)
        if (len(plain) != 8 + 2 * shamir.SHARE_BYTES
                or int.from_bytes(plain[:4], "big") != src
                or int.from_bytes(plain[4:8], "big") != self.me):
            raise SecAggError(f"site {self.me}: shares from site {src} name other sites")
        b = shamir.share_from_bytes(self.me, plain[8:8 + shamir.SHARE_BYTES])
        return b, shamir.share_from_bytes(self.me, plain[8 + shamir.SHARE_BYTES:])

    def masked_input(self, relay: ShareRelay, update: np.ndarray, weight: float,
                     noise: NoiseShare | None = None, private: Spans | None = None,
                     metrics: Mapping[str, float] | None = None) -> MaskedInput:
        """Clip, quantise, weight and mask `update` (flat float values, `params.length` of
        them). The pairwise masks are those of the neighbours whose shares arrived: exactly
        the sites the aggregator can unmask for if they drop later.

        With `noise` (distributed DP) the update is first clipped to its L2 norm and given
        this site's noise share for n_min = the threshold (noise_share.py), over the
        `private` spans (all values when None), and the weight is 1: a site's influence on
        the sum must be bounded by the clip, not by the examples it claims.

        `metrics` (the round's train metrics) go masked after the weight when the round has
        room for them (masked_metrics.py); with `noise` the evaluation only: a sum of the
        training numbers is not noised."""
        self._expect(Stage.SHARE_KEYS, "masking the input")
        p = self.params
        if update.shape != (p.length,):
            raise SecAggError(f"site {self.me}: the update has shape {update.shape}, the round "
                              f"expects ({p.length},)")
        for item in relay.sealed:
            if item.peer in self._held:
                raise SecAggError(f"site {self.me}: shares from site {item.peer} relayed twice")
            self._held[item.peer] = self._open(item)
        if len(self._held) < p.threshold:
            raise BelowThreshold(Stage.SHARE_KEYS, len(self._held), p.threshold, "shareholders")
        if noise is not None:
            # Checked here too: a site never trusts numbers it can verify (Setup's threshold).
            why = noise.range_problem(p.clip, p.threshold)
            if why is not None:
                raise SecAggError(f"site {self.me}: {why}")
            update, self.noise_report = add_share(update, noise, p.threshold, p.clip, private)
            weight = 1.0
        w = site_weight(weight, p.max_weight)
        extra = None
        if p.metrics:
            extra = masked_metrics.encode(metrics, w, ring_dtype(p.ring_bits),
                                          train=noise is None)
        vector = encode(update, w, p.clip, p.bits, p.ring_bits,
                        self._rng if p.stochastic else None, extra)
        seeds = [(self._b, 1)]
        for peer in sorted(self._held):
            if peer != self.me:
                seed = crypto.mask_seed(self._s, self._peers[peer].s_public,
                                        self.setup.context, self.me, peer)
                # The smaller index adds, the larger subtracts: the pair cancels in the sum.
                seeds.append((seed, 1 if self.me < peer else -1))
        apply_masks(vector, seeds)
        self.stage = Stage.MASKED_INPUT
        return MaskedInput(self.me, vector)

    def consistency(self, view: SurvivorView) -> ViewSignature:
        """Signed rounds: sign the survivor set the aggregator shows this site. Its unmask
        answer then needs a threshold of signatures of this same set."""
        self._expect(Stage.MASKED_INPUT, "the consistency check")
        self.stage = Stage.CONSISTENCY
        if self.identity is None:
            raise SecAggError(f"site {self.me}: a consistency check in an unsigned round")
        if self.me not in view.survivors:
            raise SecAggError(f"site {self.me}: aborted: the survivor set it was shown leaves "
                              "out its own input")
        self._view = view.survivors
        return ViewSignature(self.me, self.identity.sign(
            view_statement(self.setup.context, view.survivors)))

    def _check_views(self, request: UnmaskRequest) -> None:
        """The consistency check (Bonawitz et al. 2017, round 3): the request agrees with
        the survivor set this site signed, every signature relayed is of that same set, and
        at least `threshold` sites (this one included) signed it."""
        assert self._view is not None
        view = set(self._view)
        holders = set(self.neighbours) | {self.me}
        if set(request.survivors) != holders & view or set(request.dropped) & view:
            raise SecAggError(f"site {self.me}: aborted: the unmask request disagrees with "
                              "the survivor set it signed")
        statement = view_statement(self.setup.context, self._view)
        signed = {self.me}
        for sig in request.signatures:
            cert = self._certs.get(sig.index)
            if cert is None or sig.index not in view:
                raise SecAggError(f"site {self.me}: aborted: a survivor-set signature of "
                                  f"site {sig.index}, not a surviving neighbour")
            if not verify(cert, sig.signature, statement):
                raise SecAggError(f"site {self.me}: aborted: site {sig.index} signed another "
                                  "set of survivors than this site was shown (the aggregator "
                                  "showed sites different survivors)")
            signed.add(sig.index)
        if len(signed) < self.params.threshold:
            raise SecAggError(f"site {self.me}: aborted: {len(signed)} sites signed the "
                              f"survivor set, threshold {self.params.threshold}")

    def unmask(self, request: UnmaskRequest) -> UnmaskReply:
        if self.identity is not None:
            # A signed round answers only after the consistency check.
            self._expect(Stage.CONSISTENCY, "unmasking")
        else:
            self._expect(Stage.MASKED_INPUT, "unmasking")
        # Answered at most once: a second request could ask for the other kind of share.
        self.stage = Stage.UNMASK
        if self.identity is not None:
            self._check_views(request)
        dropped, survivors = set(request.dropped), set(request.survivors)
        both = dropped & survivors
        if both:
            raise SecAggError(f"site {self.me}: asked for both secrets of site(s) "
                              f"{sorted(both)}; refused (double-masking rule)")
        if self.me not in survivors or self.me in dropped:
            raise SecAggError(f"site {self.me}: the request does not count its own input")
        unknown = (dropped | survivors) - set(self._held)
        if unknown:
            raise SecAggError(f"site {self.me}: holds no shares of site(s) {sorted(unknown)}")
        t = self.params.threshold
        if len(survivors) < t:
            # Fewer inputs than the threshold: the sum would be too close to single updates.
            raise BelowThreshold(Stage.MASKED_INPUT, len(survivors), t)
        shares = [RevealedShare(o, ShareKind.SELF_MASK, self._held[o][0].y_bytes())
                  for o in survivors]
        shares += [RevealedShare(o, ShareKind.MASK_KEY, self._held[o][1].y_bytes())
                   for o in dropped]
        return UnmaskReply(self.me, tuple(shares))
