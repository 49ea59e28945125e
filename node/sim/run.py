"""A process's simulated nodes together: one asyncio loop on grpc.aio, so a thousand of them
cost a few hundred MB and no thread each (a bulk transfer runs on a thread while it lasts).

With `update_file`, every node's update is that safetensors file, sent from disk, and the
models it downloads are checked against their digest and dropped: big-model benchmarks (six
3.4 GB updates) then fit in one machine's memory.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time

from fedgpu.core.transport import aio_channel
from fedgpu.node.sim.node import SimNode
from fedgpu.node.sim.records import SimConfig, SimStats
from fedgpu.node.sim.synthetic import Noise

log = logging.getLogger("fedgpu.sim")


async def run_sim(cfg: SimConfig, stop: asyncio.Event | None = None) -> SimStats:
    """Register every node, then run them until each loop ended (the aggregator said stop, or
    an error no retry fixes) or `stop` is set (SIGTERM / SIGINT when not given)."""
    stats = SimStats()
    noise = Noise()
    per_channel = max(1, cfg.nodes_per_channel)
    channels = [aio_channel(cfg.aggregator, cfg.tls)
                for _ in range(math.ceil(cfg.nodes / per_channel))]
    nodes = [SimNode(cfg.start_index + i, cfg, channels[i // per_channel], stats, noise)
             for i in range(cfg.nodes)]
    started = time.perf_counter()
    deadline = time.monotonic() + cfg.connect_timeout_s
    # Bounded concurrency: a thousand simultaneous handshakes gain nothing over fifty.
    gate = asyncio.Semaphore(50)

    async def register(node: SimNode) -> None:
        async with gate:
            await node.register(deadline)

    async def register_all() -> None:
        # The first alone, and it looks at why a connection fails (TLS, a wrong port): one
        # probe for the process, not one per node.
        await nodes[0].register(deadline, diagnose=True)
        await asyncio.gather(*(register(n) for n in nodes[1:]))

    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    try:
        await register_all()
        stats.registered = len(nodes)
        stats.register_seconds = time.perf_counter() - started
        log.info("%d simulated nodes registered in %.1fs", len(nodes), stats.register_seconds)
        stats.write(cfg.stats_file)
        # Until the aggregator says it shuts down, or we are told to stop: a federation that
        # stays up keeps its nodes between jobs, and across its own restarts.
        serving = asyncio.ensure_future(asyncio.gather(*(n.run() for n in nodes)))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not stop.is_set():
            stopping.cancel()
            serving.result()  # the nodes ended on their own: their error, if any, is ours
        serving.cancel()
        await asyncio.gather(serving, stopping, return_exceptions=True)
    finally:
        for ch in channels:
            await ch.close()
        stats.write(cfg.stats_file)
    return stats
