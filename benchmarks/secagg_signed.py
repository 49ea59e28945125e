"""The signed protocol (sites with TLS identities: signed keys and the consistency check,
fedgpu/core/secagg/identity.py) beside today's unsigned one, in one process, per K.

    python -m benchmarks.secagg_signed --params 1000000 --sites 10 50 100 --neighbours 16

For each K it runs the whole protocol twice on the same update (unsigned, then signed with
certificates from a throwaway CA made like `fedgpu certs`), 10% of the sites dropping after
sharing keys, and prints one JSON line: each party's time per stage summed over the sites and
divided by K (what one site spends; in a deployment the sites run in parallel), the
aggregator's time, and the signed variant's overhead on their sum ("overhead"), the figure the
issue bounds at 10%. Training and the network are not in it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedgpu.core import certs
from fedgpu.core.secagg.aggregator import AggregatorSession
from fedgpu.core.secagg.identity import SiteIdentity
from fedgpu.core.secagg.messages import (
    KeyRelay,
    MaskedInput,
    PublicKeys,
    ShareKeys,
    ShareRelay,
    SurvivorView,
    UnmaskReply,
    UnmaskRequest,
    ViewSignature,
)
from fedgpu.core.secagg.params import Settings
from fedgpu.core.secagg.site import SiteSession


def identities(k: int, workdir: Path) -> list[SiteIdentity]:
    ca = workdir / "ca"
    certs.init_ca(ca)
    out = []
    for i in range(k):
        issued = certs.issue_node(ca, f"site-{i + 1}")
        out.append(SiteIdentity.from_files(issued.cert, issued.key, issued.ca))
    return out


def run(k: int, length: int, neighbours: int | None,
        ids: Sequence[SiteIdentity] = ()) -> dict[str, float]:
    """One round through every stage, each message through its byte encoding; seconds."""
    rng = np.random.default_rng(0)
    update = rng.uniform(-0.1, 0.1, length).astype(np.float32)
    site_s = agg_s = 0.0

    def timed(fn, *args):  # noqa: ANN001, ANN202 - a benchmark's stopwatch
        t0 = time.perf_counter()
        out = fn(*args)
        return out, time.perf_counter() - t0

    t0 = time.perf_counter()
    agg = AggregatorSession(Settings(neighbours=neighbours).resolve(k, length),
                            roster=tuple(i.name for i in ids))
    sites = {i: SiteSession(s, identity=ids[i - 1] if ids else None)
             for i, s in agg.start().items()}
    agg_s += time.perf_counter() - t0
    for s in sites.values():
        msg, dt = timed(lambda s=s: s.advertise().encode())
        site_s += dt
        agg_s += timed(agg.receive_keys, PublicKeys.decode(msg))[1]
    relays, dt = timed(agg.close_keys)
    agg_s += dt
    for i, relay in relays.items():
        msg, dt = timed(lambda i=i, r=relay: sites[i].share_keys(
            KeyRelay.decode(r.encode())).encode())
        site_s += dt
        agg_s += timed(agg.receive_shares, ShareKeys.decode(msg))[1]
    dropped = set(range(1, max(1, k // 10) + 1))
    shares, dt = timed(agg.close_shares)
    agg_s += dt
    for i, relay in shares.items():
        if i in dropped:
            continue
        msg, dt = timed(lambda i=i, r=relay: sites[i].masked_input(
            ShareRelay.decode(r.encode()), update, 100).encode())
        site_s += dt
        agg_s += timed(agg.receive_masked, MaskedInput.decode(msg))[1]
    out, dt = timed(agg.close_masked)
    agg_s += dt
    if agg.signed:
        for i, view in out.items():
            msg, dt = timed(lambda i=i, v=view: sites[i].consistency(
                SurvivorView.decode(v.encode())).encode())
            site_s += dt
            agg_s += timed(agg.receive_view, ViewSignature.decode(msg))[1]
        out, dt = timed(agg.close_consistency)
        agg_s += dt
    for i, request in out.items():
        msg, dt = timed(lambda i=i, r=request: sites[i].unmask(
            UnmaskRequest.decode(r.encode())).encode())
        site_s += dt
        agg_s += timed(agg.receive_unmask, UnmaskReply.decode(msg))[1]
    agg_s += timed(agg.finish)[1]
    return {"site_s": site_s / k, "agg_s": agg_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=1_000_000)
    ap.add_argument("--sites", type=int, nargs="+", default=[10, 50, 100])
    ap.add_argument("--neighbours", type=int, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for k in args.sites:
            ids = identities(k, Path(tmp) / f"k{k}")
            plain = run(k, args.params, args.neighbours)
            signed = run(k, args.params, args.neighbours, ids)
            base = plain["site_s"] + plain["agg_s"]
            print(json.dumps({
                "sites": k, "params": args.params, "neighbours": args.neighbours or "all",
                "unsigned_site_s": round(plain["site_s"], 4),
                "unsigned_agg_s": round(plain["agg_s"], 3),
                "signed_site_s": round(signed["site_s"], 4),
                "signed_agg_s": round(signed["agg_s"], 3),
                "overhead": round((signed["site_s"] + signed["agg_s"]) / base - 1, 4),
            }), flush=True)


if __name__ == "__main__":
    main()
