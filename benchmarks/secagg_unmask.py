"""Secure aggregation's cost, in one process: a site's masking time and the aggregator's
add-per-input and unmasking time for K sites, with 10% of the sites dropping after sharing
keys (their pairwise masks are rebuilt and removed too).

    python -m benchmarks.secagg_unmask --params 1000000 --sites 10 50 100 --neighbours 16

Prints one JSON line per K. Sites are simulated one after another, so a run with K sites
costs K maskings; the aggregator's numbers are what a real round spends on the server.
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc

import numpy as np

from fedgpu.core.secagg.aggregator import AggregatorSession
from fedgpu.core.secagg.messages import MaskedInput
from fedgpu.core.secagg.params import Settings
from fedgpu.core.secagg.site import SiteSession


def measure(k: int, length: int, neighbours: int | None) -> dict[str, float]:
    rng = np.random.default_rng(0)
    agg = AggregatorSession(Settings(neighbours=neighbours).resolve(k, length))
    sites = {i: SiteSession(s) for i, s in agg.start().items()}
    for s in sites.values():
        agg.receive_keys(s.advertise())
    for i, relay in agg.close_keys().items():
        agg.receive_shares(sites[i].share_keys(relay))
    dropped = set(range(1, max(1, k // 10) + 1))
    update = rng.uniform(-0.1, 0.1, length).astype(np.float32)
    mask_s = add_s = 0.0
    for i, relay in agg.close_shares().items():
        if i in dropped:
            continue
        t0 = time.perf_counter()
        data = sites[i].masked_input(relay, update, 100).encode()
        t1 = time.perf_counter()
        agg.receive_masked(MaskedInput.decode(data))
        add_s += time.perf_counter() - t1
        mask_s += t1 - t0
    for i, request in agg.close_masked().items():
        agg.receive_unmask(sites[i].unmask(request))
    tracemalloc.start()
    t0 = time.perf_counter()
    out = agg.finish()
    unmask_s = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    counted = k - len(dropped)
    return {"sites": k, "params": length, "neighbours": agg.params.degree,
            "site_mask_s": round(mask_s / counted, 4), "agg_add_s": round(add_s / counted, 4),
            "agg_unmask_s": round(unmask_s, 3), "recovered": out.report.recovered,
            "unmask_peak_models": round(peak / ((length + 1) * 8), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=1_000_000)
    ap.add_argument("--sites", type=int, nargs="+", default=[10, 50, 100])
    ap.add_argument("--neighbours", type=int, default=None)
    args = ap.parse_args()
    for k in args.sites:
        print(json.dumps(measure(k, args.params, args.neighbours)), flush=True)


if __name__ == "__main__":
    main()
