"""Issue 37's point 7 in one run: a 512 MiB update pushed to a running aggregator over its bulk
port against a plain socket copy of the same size, side by side, several pairs.

    python -m benchmarks.ingest_ratio --size-mib 512 --pairs 5

Each pair runs `benchmarks.transport raw` (best of --repeat sends into a receiver process)
and then `benchmarks.wire_e2e --path bulk` (a `fedgpu sim` node's whole upload: ticket, bytes,
the aggregator's BLAKE3_SEGMENTS check and finite scan as they land, decode, validation,
verdict; best of --rounds training rounds), each in fresh processes, one right after the
other so both see the same machine. The ratio is raw seconds / push seconds; the median of
the pairs is the figure, the spread says how steady the machine was. On a small VM the raw
copy itself moves by tens of percent from one minute to the next: read the pairs, not one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchmarks.common import emit, run_case


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    size = str(a.size_mib)
    pairs = []
    for i in range(a.pairs):
        raw = run_case("benchmarks.transport", ["raw", "--size-mib", size, "--repeat",
                                                str(a.repeat)], timeout=900)
        bulk = run_case("benchmarks.wire_e2e", ["--path", "bulk", "--size-mib", size,
                                                "--rounds", str(a.rounds)], timeout=900)
        raw_s, push_s = float(raw["seconds"]), float(bulk["push_seconds"])
        pair = {"pair": i + 1, "raw_s": raw_s, "push_s": push_s,
                "ratio": round(raw_s / push_s, 3), "ingest_split_s": bulk["ingest_split_s"],
                "at": time.strftime("%H:%M:%S", time.gmtime())}
        pairs.append(pair)
        print(json.dumps(pair), file=sys.stderr, flush=True)
    ratios = [p["ratio"] for p in pairs]
    emit({"size_mib": a.size_mib, "pairs": pairs, "median_ratio": statistics.median(ratios),
          "min_ratio": min(ratios), "max_ratio": max(ratios),
          "pairs_at_or_over_80pct": sum(r >= 0.8 for r in ratios)})


if __name__ == "__main__":
    main()
