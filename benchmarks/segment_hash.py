"""How fast a receiver checks a payload's BLAKE3_SEGMENTS digest, on one thread and on several.

    python -m benchmarks.segment_hash --size-mib 512 --threads 1,2 --repeat 5

The payload (random bytes, in memory) is fed to fedgpu.core.segment_hasher.SegmentHasher in
8 MiB blocks, as the bulk port's receive hands them over, with the announced segment digests
checked as each segment completes. Reported: GB/s per thread count (best and median of the
repeats), and the CPU count. No socket: this is the hash alone, the part of the aggregator's
receive that one thread could not keep up with on a many-core machine (BENCHMARKS.md §18).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.common import MIB, emit
from fedgpu.core import segment_hasher

BLOCK = 8 * MIB


def _once(data: memoryview, digests: bytes, threads: int) -> float:
    h = segment_hasher.SegmentHasher(data.nbytes, digests, threads=threads)
    t0 = time.perf_counter()
    for pos in range(0, data.nbytes, BLOCK):
        h.update(data[pos:pos + BLOCK])
    took = time.perf_counter() - t0
    assert h.verified == data.nbytes
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if not 1 <= args.size_mib <= 16384 or not 1 <= args.repeat <= 100:
        ap.error("--size-mib must be 1..16384 and --repeat 1..100")
    counts = [int(t) for t in args.threads.split(",")]
    if any(not 1 <= t <= segment_hasher.MAX_THREADS for t in counts):
        ap.error(f"--threads must be 1..{segment_hasher.MAX_THREADS} each")
    data = memoryview(os.urandom(args.size_mib * MIB))
    _, digests = segment_hasher.of_views([data])
    rows = []
    for _ in range(args.repeat):  # alternated, so drift on a shared machine hits each alike
        for t in counts:
            rows.append((t, _once(data, digests, t)))
    gb = args.size_mib * MIB / 1e9
    result = {"size_mib": args.size_mib, "cpus": len(os.sched_getaffinity(0)),
              "default_threads": segment_hasher.receive_threads(),
              "load_1min": round(os.getloadavg()[0], 2), "by_threads": {}}
    for t in counts:
        secs = [s for n, s in rows if n == t]
        result["by_threads"][str(t)] = {
            "best_gb_per_s": round(gb / min(secs), 3),
            "median_gb_per_s": round(gb / statistics.median(secs), 3)}
    emit(result)


if __name__ == "__main__":
    main()
