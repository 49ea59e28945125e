"""The aggregator's side of one secure-aggregation round, as a state machine without I/O.

    agg = AggregatorSession(settings.resolve(n, length))
    agg.setup(i) for each site                 -> Setup
    agg.receive_keys(msg) ...; agg.close_keys()        -> {site: KeyRelay}
    agg.receive_shares(msg) ...; agg.close_shares()    -> {site: ShareRelay}
    agg.receive_masked(msg) ...; agg.close_masked()    -> {site: UnmaskRequest}
                                   (signed rounds: -> {site: SurvivorView}, then
    agg.receive_view(msg) ...; agg.close_consistency() -> {site: UnmaskRequest})
    agg.receive_unmask(msg) ...; agg.finish()          -> Outcome

The caller owns time: whatever has not arrived when it closes a stage is a dropout at that
stage. Masked inputs are added into one running sum as they arrive (memory: the sum and the
message being added, never one vector per site), and `finish` removes the masks block by
block. A `receive_*` that raises has recorded nothing: the caller drops that site. A `close_*`
or `finish` that raises BelowThreshold ends the round.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from fedgpu.core.secagg import crypto, graph, masked_metrics, shamir
from fedgpu.core.secagg.errors import BelowThreshold, SecAggError, Stage
from fedgpu.core.secagg.messages import (
    CONTEXT_BYTES,
    KeyRelay,
    MaskedInput,
    PublicKeys,
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
from fedgpu.core.secagg.params import RoundParams
from fedgpu.core.secagg.prg import SEED_BYTES, apply_masks, ring_dtype
from fedgpu.core.secagg.quantize import decode_sum


@dataclass(frozen=True)
class RoundReport:
    """What `fedgpu rounds` shows for a secure round."""

    sites: int
    # Sites whose masked update is in the result.
    masked: int
    # Site indices that dropped, by the stage they failed to answer.
    dropped: dict[Stage, tuple[int, ...]] = field(default_factory=dict)
    # Dropped sites whose pairwise masks were rebuilt and removed from the sum.
    recovered: int = 0
    seconds: float = 0.0


@dataclass(frozen=True, eq=False)
class Outcome:
    # The weighted mean of the surviving sites' (clipped, quantised) updates.
    mean: np.ndarray
    total_weight: int
    report: RoundReport
    # The sites' training numbers, summed while masked (masked_metrics.decode); empty when
    # the round carried none.
    metrics: dict[str, dict[str, float | int]] = field(default_factory=dict)


class AggregatorSession:
    def __init__(self, params: RoundParams, context: bytes | None = None,
                 graph_seed: bytes | None = None, roster: tuple[str, ...] = ()) -> None:
        """`roster`: the site name at each index, sent in every Setup so that sites with a
        TLS identity can match their neighbours' certificates to indices."""
        params.check()
        self.params = params
        self.roster = roster
        # Signed round (every site signs its keys): the consistency check runs before
        # unmasking; decided when the keys are in, from what the sites sent.
        self.signed = False
        self._views: dict[int, ViewSignature] = {}
        self.context = context if context is not None else os.urandom(CONTEXT_BYTES)
        self.graph_seed = graph_seed if graph_seed is not None else os.urandom(SEED_BYTES)
        if len(self.context) != CONTEXT_BYTES or len(self.graph_seed) != SEED_BYTES:
            raise SecAggError("the round context and graph seed are 32 bytes each")
        self.sites = tuple(range(1, params.n_sites + 1))
        self.neighbours = graph.neighbours(params.n_sites, params.degree, self.graph_seed)
        self.stage = Stage.SETUP
        self.finished = False
        self._started = time.monotonic()
        self._keys: dict[int, PublicKeys] = {}
        self._relayed: dict[int, frozenset[int]] = {}
        self._sealed: dict[int, tuple[Sealed, ...]] = {}
        self._masked: set[int] = set()
        self._sum: np.ndarray | None = None
        # The one kind of secret asked for per site: the double-masking rule, kept here.
        self.asked: dict[int, ShareKind] = {}
        self._requests: dict[int, UnmaskRequest] = {}
        self._shares: dict[tuple[int, ShareKind], list[shamir.Share]] = {}
        self._answered: set[int] = set()
        # Secrets rebuilt in `finish`, by site: what the aggregator ever learns besides the sum.
        self.revealed: dict[int, ShareKind] = {}

    def _expect(self, stage: Stage, step: str) -> None:
        if self.finished:
            raise SecAggError(f"{step} after the round finished")
        if self.stage != stage:
            raise SecAggError(f"{step} while the round is at {self.stage}")

    def setup(self, index: int) -> Setup:
        if index not in self.sites:
            raise SecAggError(f"no site {index} in this round of {self.params.n_sites}")
        return Setup(self.context, index, self.graph_seed, self.params, self.roster)

    def start(self) -> dict[int, Setup]:
        self._expect(Stage.SETUP, "starting")
        self.stage = Stage.ADVERTISE_KEYS
        return {i: self.setup(i) for i in self.sites}

    def _check_below(self, stage: Stage, alive: int) -> None:
        if alive < self.params.threshold:
            raise BelowThreshold(stage, alive, self.params.threshold)

    # -- advertise keys ------------------------------------------------------------------

    def receive_keys(self, msg: PublicKeys) -> None:
        self._expect(Stage.ADVERTISE_KEYS, "public keys arrived")
        if msg.index not in self.sites or msg.index in self._keys:
            raise SecAggError(f"public keys from unknown or repeated site {msg.index}")
        if msg.c_public == msg.s_public:
            raise SecAggError(f"site {msg.index} advertised the same key twice")
        self._keys[msg.index] = msg

    def close_keys(self) -> dict[int, KeyRelay]:
        self._expect(Stage.ADVERTISE_KEYS, "closing advertise-keys")
        self._check_below(Stage.ADVERTISE_KEYS, len(self._keys))
        self.stage = Stage.SHARE_KEYS
        # The aggregator cannot check the signatures (sites do); it only runs the extra stage.
        self.signed = any(k.signature for k in self._keys.values())
        relays = {}
        for u in self._keys:
            peers = self.neighbours[u] & self._keys.keys()
            self._relayed[u] = frozenset(peers)
            relays[u] = KeyRelay(tuple(self._keys[v] for v in sorted(peers)))
        return relays

    # -- share keys ----------------------------------------------------------------------

    def receive_shares(self, msg: ShareKeys) -> None:
        self._expect(Stage.SHARE_KEYS, "shares arrived")
        u = msg.index
        if u not in self._relayed or u in self._sealed:
            raise SecAggError(f"shares from site {u}, which has no keys relayed or sent twice")
        if {s.peer for s in msg.sealed} != self._relayed[u]:
            raise SecAggError(f"site {u} did not send shares to exactly its neighbours")
        self._sealed[u] = msg.sealed

    def close_shares(self) -> dict[int, ShareRelay]:
        self._expect(Stage.SHARE_KEYS, "closing share-keys")
        self._check_below(Stage.SHARE_KEYS, len(self._sealed))
        self.stage = Stage.MASKED_INPUT
        inbox: dict[int, list[Sealed]] = {u: [] for u in self._sealed}
        for src, items in self._sealed.items():
            for s in items:
                if s.peer in inbox:
                    inbox[s.peer].append(Sealed(src, s.data))
        return {u: ShareRelay(tuple(items)) for u, items in inbox.items()}

    # -- masked input --------------------------------------------------------------------

    def receive_masked(self, msg: MaskedInput) -> None:
        """Adds the input into the running sum (mod 2^ring_bits)."""
        self._expect(Stage.MASKED_INPUT, "a masked input arrived")
        u, v = msg.index, msg.vector
        if u not in self._sealed or u in self._masked:
            raise SecAggError(f"masked input from site {u}, which shared no keys or sent twice")
        dtype = ring_dtype(self.params.ring_bits)
        if v.shape != (self.params.vector_length,) or v.dtype != dtype:
            raise SecAggError(f"masked input from site {u} has {v.size} {v.dtype} values, the "
                              f"round expects {self.params.vector_length} {dtype}")
        if self._sum is None:
            self._sum = v.copy()
        else:
            np.add(self._sum, v, out=self._sum)
        self._masked.add(u)

    def close_masked(self) -> dict[int, UnmaskRequest] | dict[int, SurvivorView]:
        self._expect(Stage.MASKED_INPUT, "closing masked-input")
        self._check_below(Stage.MASKED_INPUT, len(self._masked))
        self.stage = Stage.CONSISTENCY if self.signed else Stage.UNMASK
        dropped = set(self._sealed) - self._masked
        for v in sorted(self._masked):
            self._ask(v, ShareKind.SELF_MASK)
        for v in sorted(dropped):
            self._ask(v, ShareKind.MASK_KEY)
        for u in self._masked:
            holders = self.neighbours[u] | {u}
            self._requests[u] = UnmaskRequest(tuple(sorted(holders & dropped)),
                                              tuple(sorted(holders & self._masked)))
        if self.signed:
            view = SurvivorView(tuple(sorted(self._masked)))
            return {u: view for u in self._masked}
        return dict(self._requests)

    # -- consistency check (signed rounds) -----------------------------------------------

    def receive_view(self, msg: ViewSignature) -> None:
        self._expect(Stage.CONSISTENCY, "a survivor-set signature arrived")
        if msg.index not in self._masked or msg.index in self._views:
            raise SecAggError(f"a survivor-set signature from site {msg.index}, which is not "
                              "a survivor or signed already")
        self._views[msg.index] = msg

    def close_consistency(self) -> dict[int, UnmaskRequest]:
        """Each survivor that signed gets its unmask request with the signatures of its
        neighbours; a survivor that did not sign still counts (its input is in the sum)."""
        self._expect(Stage.CONSISTENCY, "closing the consistency check")
        self._check_below(Stage.CONSISTENCY, len(self._views))
        self.stage = Stage.UNMASK
        self._requests = {
            u: UnmaskRequest(r.dropped, r.survivors,
                             tuple(self._views[v] for v in sorted(self.neighbours[u])
                                   if v in self._views))
            for u, r in self._requests.items() if u in self._views}
        return dict(self._requests)

    def _ask(self, site: int, kind: ShareKind) -> None:
        if self.asked.setdefault(site, kind) != kind:
            raise SecAggError(f"both secrets of site {site} asked for (double-masking rule)")

    # -- unmask --------------------------------------------------------------------------

    def receive_unmask(self, msg: UnmaskReply) -> None:
        self._expect(Stage.UNMASK, "shares for unmasking arrived")
        u = msg.index
        request = self._requests.get(u)
        if request is None or u in self._answered:
            raise SecAggError(f"unmask shares from site {u}, which was not asked or answered")
        wanted = {(o, ShareKind.MASK_KEY) for o in request.dropped}
        wanted |= {(o, ShareKind.SELF_MASK) for o in request.survivors}
        if {(s.owner, s.kind) for s in msg.shares} != wanted:
            raise SecAggError(f"site {u} did not answer with exactly the shares asked for")
        parsed = [(s, shamir.share_from_bytes(u, s.y)) for s in msg.shares]
        for s, share in parsed:
            self._shares.setdefault((s.owner, s.kind), []).append(share)
        self._answered.add(u)

    def _rebuild(self, site: int, kind: ShareKind) -> bytes:
        if self.asked.get(site) != kind:
            raise SecAggError(f"site {site}'s {kind} was never asked for")
        shares = self._shares.get((site, kind), [])
        t = self.params.threshold
        if len(shares) < t:
            raise BelowThreshold(Stage.UNMASK, len(shares), t, f"shares of site {site}'s {kind}")
        secret = shamir.combine(shares[:t])
        self.revealed[site] = kind
        return secret

    def finish(self) -> Outcome:
        """Rebuild the secrets, remove every mask, and return the weighted mean."""
        self._expect(Stage.UNMASK, "finishing")
        assert self._sum is not None  # close_masked saw at least `threshold` inputs
        self._check_below(Stage.UNMASK, len(self._answered))
        corrections: list[tuple[bytes, int]] = []
        for v in sorted(self._masked):
            corrections.append((self._rebuild(v, ShareKind.SELF_MASK), -1))
        dropped = sorted(set(self._sealed) - self._masked)
        recovered = 0
        for v in dropped:
            partners = sorted(self.neighbours[v] & self._masked)
            if not partners:
                continue
            pair = crypto.KeyPair.from_secret(self._rebuild(v, ShareKind.MASK_KEY))
            if pair.public != self._keys[v].s_public:
                raise SecAggError(f"the shares of site {v}'s mask key do not match its key")
            for u in partners:
                seed = crypto.mask_seed(pair, self._keys[u].s_public, self.context, v, u)
                # u added +mask when u < v: take it back out, and the reverse.
                corrections.append((seed, -1 if u < v else 1))
            recovered += 1
        total = self._sum
        self._sum = None
        apply_masks(total, corrections)
        p = self.params
        mean, weight = decode_sum(total[:p.length + 1], p.clip, p.bits)
        metrics = masked_metrics.decode(total[p.length + 1:]) if p.metrics else {}
        self.finished = True
        report = RoundReport(
            sites=p.n_sites, masked=len(self._masked),
            dropped={s: d for s, d in (
                (Stage.ADVERTISE_KEYS, tuple(sorted(set(self.sites) - set(self._keys)))),
                (Stage.SHARE_KEYS, tuple(sorted(set(self._keys) - set(self._sealed)))),
                (Stage.MASKED_INPUT, tuple(dropped)),
                (Stage.UNMASK, tuple(sorted(self._masked - self._answered)))) if d},
            recovered=recovered, seconds=time.monotonic() - self._started)
        return Outcome(mean, weight, report, metrics)
