"""FedAvg of K updates: fedgpu vs Flower's `aggregate` vs plain numpy vs the read-once bound.

One case per process so peak RSS belongs to it alone:
    python -m benchmarks.aggregation --impl fedgpu --k 10 --params 11000000
`extra_mib` is the peak resident memory above what the K input models themselves take.
`cpu_seconds` is the best process CPU time (all threads): on a machine shared with other work
the wall time includes time spent waiting for a core, CPU time does not.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from benchmarks.common import MIB, emit, model_arrays, peak_rss_mib, rss_mib


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", required=True,
                    choices=["fedgpu", "fedgpu_stream", "fedgpu_stream_normed", "fedgpu_burst",
                             "fedgpu_int8",
                             "fedgpu_topk", "numpy", "numpy_add", "bound", "flower"])
    ap.add_argument("--k", type=int, required=True)
    ap.add_argument("--params", type=int, required=True)
    ap.add_argument("--tensors", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    updates = [model_arrays(a.params, a.tensors, seed=i) for i in range(a.k)]
    weights = [int(10 + 7 * i) for i in range(a.k)]
    names = [f"t{i:02d}" for i in range(a.tensors)]
    dicts = [dict(zip(names, u, strict=True)) for u in updates]
    if a.impl.startswith("fedgpu"):
        # What a running aggregator holds from its first round on (scipy's BLAS and its
        # buffers, from a first axpy; the compiled loops of fedgpu.core.fused_loops): loaded
        # once per process, not per sum, so part of the baseline, not of the sum's extra
        # memory. A small sum of each kind, inputs made as the measured ones are.
        warm_up(names[:2])
        if a.impl == "fedgpu_burst":  # the round machinery a running aggregator has loaded
            import fedgpu.server.rounds.folding  # noqa: F401
    base = rss_mib()
    # The streamed cases run as rounds do: each sum takes over the last one's memory.
    spare: list[dict[str, np.ndarray] | None] = [None]

    if a.impl == "fedgpu":
        from fedgpu.server.strategies.aggregate import weighted_mean

        def run() -> object:
            return weighted_mean(list(zip(dicts, map(float, weights), strict=True)))
    elif a.impl == "fedgpu_stream":
        from fedgpu.server.strategies.aggregate import WeightedSum

        def run() -> object:
            # What the aggregator does: one update at a time as each arrives, into the memory
            # of the last round's sum (FedAvg keeps it as a spare: no page faults).
            acc = WeightedSum(dicts[0], spare.pop())
            for d, w in zip(dicts, weights, strict=True):
                acc.add(d, float(w))
            spare.append(acc.mean())
            return spare[-1]
    elif a.impl == "fedgpu_stream_normed":
        from fedgpu.server.rounds.validation import check_finite
        from fedgpu.server.strategies.aggregate import WeightedSum

        # As the aggregator gets them: validation's finite check (one dot per chunk, run on
        # every update before it is aggregated, not timed here) measured each tensor's norm,
        # so the sum knows before writing that nothing can overflow: no check per block.
        normed = [check_finite(d) for d in dicts]

        def run() -> object:
            acc = WeightedSum(normed[0], spare.pop())
            for d, w in zip(normed, weights, strict=True):
                acc.add(d, float(w))
            spare.append(acc.mean())
            return spare[-1]
    elif a.impl == "fedgpu_burst":
        import asyncio

        from fedgpu.proto import pb
        from fedgpu.server.rounds.attempt import RoundState
        from fedgpu.server.rounds.folding import FoldQueue, Waiting
        from fedgpu.server.rounds.validation import check_finite
        from fedgpu.server.strategies.fedavg import FedAvg

        # K validated updates handed to the aggregator's fold queue at once, as a round's
        # sites finishing together are: the first folds alone (nothing waits yet), the others
        # queue meanwhile and fold together in one sweep. FedAvg keeps its last sum as the
        # spare, as in a running job.
        normed = [check_finite(d) for d in dicts]
        strategy = FedAvg()
        loop = asyncio.new_event_loop()

        async def burst() -> object:
            folds = FoldQueue(asyncio.Lock())
            rnd = RoundState(number=1, kind=pb.TASK_KIND_TRAIN, attempt=1, required=a.k,
                             deadline=time.time() + 60, started=time.time())
            strategy.begin_round(dicts[0])
            await asyncio.gather(*(folds.fold(strategy, Waiting(rnd, d, w, {}, 0))
                                   for d, w in zip(normed, weights, strict=True)))
            return strategy.finish()

        def run() -> object:
            return loop.run_until_complete(burst())
    elif a.impl in ("fedgpu_int8", "fedgpu_topk"):
        from fedgpu.core.update_codecs import UpdateCodec, decode_update, encode_update
        from fedgpu.server.strategies.aggregate import WeightedSum

        # Compressed updates (deltas) decoded block by block straight into the sum; encoding
        # happens on the nodes, decoding to block sources is checks and views (not timed).
        kind = UpdateCodec.INT8 if a.impl == "fedgpu_int8" else UpdateCodec.TOPK
        spec = {n: ("F32", (x.size,)) for n, x in dicts[0].items()}
        sources = [decode_update(*encode_update(d, kind, 0.01), spec) for d in dicts]

        def run() -> object:
            acc = WeightedSum(dicts[0], spare.pop())
            for d, w in zip(sources, weights, strict=True):
                acc.add(d, float(w))
            spare.append(acc.mean(offset=dicts[0]))
            return spare[-1]
    elif a.impl == "numpy":
        def run() -> object:
            # The obvious in-place accumulate: multiply into scratch, add, divide.
            acc = [np.zeros_like(x) for x in updates[0]]
            scratch = np.empty(max(x.size for x in updates[0]), np.float32)
            for u, w in zip(updates, weights, strict=True):
                for s, x in zip(acc, u, strict=True):
                    t = scratch[: x.size]
                    np.multiply(x, w, out=t)
                    s += t
            total = sum(weights)
            for s in acc:
                s /= total
            return acc
    elif a.impl == "numpy_add":
        acc_add = [np.zeros_like(x) for x in updates[0]]

        def run() -> object:
            # No weights, no checks: acc += x one update at a time, into a sum already in
            # memory. One read of x and one read and write of the sum: the least any streamed
            # (one update at a time) sum costs, a floor for fedgpu_stream*.
            for u in updates:
                for s, x in zip(acc_add, u, strict=True):
                    np.add(s, x, out=s)
            return acc_add
    elif a.impl == "bound":
        def run() -> object:
            # Every input byte read once, nothing written: no aggregation can beat this.
            return [x.max() for u in updates for x in u]
    else:
        from flwr.server.strategy.aggregate import aggregate

        results = list(zip(updates, weights, strict=True))

        def run() -> object:
            return aggregate(results)

    seconds, cpu_seconds = best_wall_and_cpu(run, a.repeat)
    model_mib = a.params * 4 / MIB
    extra = max(0.0, peak_rss_mib() - base)
    emit({"impl": a.impl, "k": a.k, "params": a.params, "seconds": round(seconds, 4),
          "cpu_seconds": round(cpu_seconds, 4),
          "extra_mib": round(extra, 1), "model_mib": round(model_mib, 1),
          "extra_models": round(extra / model_mib, 2)})


def warm_up(names: list[str]) -> None:
    from fedgpu.core.update_codecs import UpdateCodec, decode_update, encode_update
    from fedgpu.server.rounds.validation import check_finite
    from fedgpu.server.strategies.aggregate import WeightedSum

    small = [dict(zip(names, model_arrays(8192, len(names), seed=i), strict=True))
             for i in range(3)]
    spec = {n: ("F32", (x.size,)) for n, x in small[0].items()}
    acc = WeightedSum(small[0])
    acc.add_many([(d, 1.0) for d in small])  # the pair loops, on plain arrays
    acc.add_many([(check_finite(d), 1.0) for d in small])  # ...and on validated ones
    for kind in (UpdateCodec.INT8, UpdateCodec.TOPK):
        acc.add(decode_update(*encode_update(small[0], kind, 0.01), spec), 1.0)
    acc.mean()


def best_wall_and_cpu(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    wall = cpu = float("inf")
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - w0)
        cpu = min(cpu, time.process_time() - c0)
    return wall, cpu


if __name__ == "__main__":
    main()
