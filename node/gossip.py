"""D-PSGD's gossip exchange on torch.distributed point-to-point ops, and who to blame when a
peer is lost.

Each exchange sends this rank's flat copy to the ranks that weight it (column of W) and
receives the copies it weights (row of W), then forms row `rank` of W x. gloo serves CPU
workers; nccl only when every worker has a GPU of its own (a card shared by two ranks cannot
run nccl p2p between them), otherwise CUDA copies cross on the CPU through gloo.

Every wait has a timeout, so a lost peer ends the block with an error instead of a hang. The
rank that sees a transport error is often not next to the dead one (its neighbour gave up
first and closed the connection), so each worker beats a counter in the rendezvous store and
writes why it stopped; the lost rank is the one whose counter stood still without a reason.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from fedgpu.core import mixing

log = logging.getLogger("fedgpu.gossip")

BEAT_S = 0.5
# Long enough for several beats even on a loaded machine, short next to any block.
LOST_WINDOW_S = 2.5


class PeerLost(RuntimeError):
    """The ring lost a rank; `lost` names it (or them) and the message says how it was seen."""

    def __init__(self, message: str, lost: list[int]) -> None:
        super().__init__(message)
        self.lost = lost


def store_of(host: str, port: int, world: int, rank: int, timeout_s: float) -> dist.TCPStore:
    # Rank 0 hosts the store; nobody waits for everyone here, init_process_group does that.
    return dist.TCPStore(host, port, world, rank == 0,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


class Liveness:
    """A beat counter per rank in the rendezvous store, on a connection of its own so a
    blocked exchange on the main thread never stops the beat."""

    def __init__(self, host: str, port: int, world: int, rank: int, timeout_s: float) -> None:
        self.world, self.rank = world, rank
        self._store = dist.TCPStore(host, port, world, False,
                                    timeout=datetime.timedelta(seconds=min(timeout_s, 10.0)))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ring-beat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                with self._lock:
                    self._store.add(f"beat/{self.rank}", 1)
            except Exception:  # noqa: BLE001 - the store's host is gone; the exchange will say
                return

    def stop(self, reason: str) -> None:
        """Stop beating and say why, so peers do not take this rank for the lost one."""
        self._stop.set()
        try:
            with self._lock:
                self._store.set(f"done/{self.rank}", reason)
        except Exception:  # noqa: BLE001
            pass

    def _read(self, key: str) -> dict[int, str]:
        # The caller holds the lock.
        return {r: self._store.get(f"{key}/{r}").decode()
                for r in range(self.world) if self._store.check([f"{key}/{r}"])}

    def _beats(self) -> list[int]:
        with self._lock:
            return [self._store.add(f"beat/{r}", 0) for r in range(self.world)]

    def lost(self) -> list[int]:
        """Ranks that stopped without a reason, or stopped with an error of their own."""
        try:
            first = self._beats()
            time.sleep(LOST_WINDOW_S)
            second = self._beats()
            with self._lock:
                done = self._read("done")
        except Exception:  # noqa: BLE001
            # The store lives in rank 0's worker, which stays until every rank has judged
            # (linger): no store, no rank 0.
            return [0] if self.rank != 0 else []
        try:
            with self._lock:
                self._store.set(f"judged/{self.rank}", "1")
        except Exception:  # noqa: BLE001
            pass
        return [r for r in range(self.world) if r != self.rank and (
            done.get(r, "").startswith("error") or (r not in done and second[r] == first[r]))]

    def linger(self, limit_s: float) -> None:
        """On rank 0, which hosts the store: keep it up until every other rank has judged who
        is lost (or is gone itself), or a survivor reading the store would find it gone and
        blame rank 0 for a death elsewhere. Other ranks return at once."""
        if self.rank != 0:
            return
        end = time.monotonic() + limit_s
        last: dict[int, tuple[int, float]] = {}
        try:
            while time.monotonic() < end:
                beats = self._beats()
                with self._lock:
                    done, judged = self._read("done"), self._read("judged")
                now = time.monotonic()
                waiting = []
                for r in range(1, self.world):
                    if r in judged or done.get(r, "peer") != "peer":
                        continue
                    seen, since = last.get(r, (-1, now))
                    if beats[r] != seen:
                        last[r] = (beats[r], now)
                    elif r not in done and now - since > LOST_WINDOW_S:
                        continue  # stopped beating without a word: the lost one
                    waiting.append(r)
                if not waiting:
                    return
                time.sleep(BEAT_S / 2)
        except Exception:  # noqa: BLE001 - nothing left to keep up
            return


def leave(liveness: Liveness, failed: bool, linger_s: float) -> None:
    """End this rank's part in the ring: close the exchange connections first (so neighbours
    notice at once), then, after a failure, keep rank 0's store up while the others judge."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if failed:
        liveness.linger(linger_s)


@dataclass
class Ring:
    rank: int
    w: np.ndarray
    timeout_s: float
    names: list[str]
    backend: str = "gloo"
    group: dist.ProcessGroup | None = None
    liveness: Liveness | None = None
    bytes_sent: int = 0
    exchanges: int = 0
    comm_seconds: float = 0.0
    send_to: list[int] = field(init=False)
    recv_from: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.send_to, self.recv_from = mixing.peers(self.w, self.rank)

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def name(self, r: int) -> str:
        return f"rank {r} ({self.names[r]})" if r < len(self.names) else f"rank {r}"

    @torch.no_grad()
    def mix_(self, flat: torch.Tensor) -> torch.Tensor:
        """Replace `flat` (this rank's copy) by row `rank` of W x, in place; returns it."""
        start = time.perf_counter()
        on_wire = flat if (self.backend == "nccl" or flat.device.type == "cpu") else flat.cpu()
        bufs = {j: torch.empty_like(on_wire) for j in self.recv_from}
        pending: list[tuple[int, dist.Work]] = []
        try:
            if self.backend == "nccl":
                # nccl needs the sends and receives of one exchange in one group call, or two
                # ranks sending to each other first both wait forever.
                ops = [dist.P2POp(dist.isend, on_wire, self._global(j), self.group)
                       for j in self.send_to]
                ops += [dist.P2POp(dist.irecv, bufs[j], self._global(j), self.group)
                        for j in self.recv_from]
                try:
                    works = dist.batch_isend_irecv(ops) if ops else []
                except RuntimeError as exc:
                    raise self.lost_error(-1, exc) from None
                peers = [*self.send_to, *self.recv_from]
                pending = list(zip(peers if len(works) == len(peers) else [-1] * len(works),
                                   works, strict=True))
            else:
                # Posting can fail too (gloo sends small messages at once): a peer already
                # gone must end in the same named, reasoned stop as a failed wait.
                for j in self.send_to:
                    try:
                        pending.append((j, dist.isend(on_wire, self._global(j), self.group)))
                    except RuntimeError as exc:
                        raise self.lost_error(j, exc) from None
                for j in self.recv_from:
                    try:
                        pending.append((j, dist.irecv(bufs[j], self._global(j), self.group)))
                    except RuntimeError as exc:
                        raise self.lost_error(j, exc) from None
            timeout = datetime.timedelta(seconds=self.timeout_s)
            for peer, work in pending:
                try:
                    work.wait(timeout)
                except RuntimeError as exc:
                    raise self.lost_error(peer, exc) from None
        finally:
            self.comm_seconds += time.perf_counter() - start
        mixed = on_wire.mul(float(self.w[self.rank, self.rank]))
        for j, buf in bufs.items():
            mixed.add_(buf, alpha=float(self.w[self.rank, j]))
        flat.copy_(mixed)
        self.bytes_sent += on_wire.numel() * on_wire.element_size() * len(self.send_to)
        self.exchanges += 1
        return flat

    def lost_error(self, peer: int, exc: BaseException) -> PeerLost:
        """A PeerLost naming the rank that is really gone, not just the one we noticed."""
        lost: list[int] = []
        if self.liveness is not None:
            self.liveness.stop("peer")
            lost = self.liveness.lost()
        if not lost and peer >= 0:
            lost = [peer]
        first = " ".join(str(exc).split())[:300]
        seen = f"exchanging with {self.name(peer)}" if peer >= 0 else "in an exchange"
        names = ", ".join(self.name(r) for r in lost) or "a peer"
        return PeerLost(f"ring lost {names}: rank {self.rank} stopped after the error "
                        f"{seen}: {first}", lost)


def flat_params(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous buffer for one send per neighbour per exchange."""
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


@torch.no_grad()
def unflatten_(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def choose_backend(store: dist.Store, rank: int, world: int, gpu: str) -> str:
    """nccl when every rank has a GPU of its own, else gloo. Agreed through the store (plain
    strings, no pickled objects): every rank reads the same list and decides the same."""
    store.set(f"device/{rank}", gpu or "cpu")
    devices = [store.get(f"device/{r}").decode() for r in range(world)]
    own_gpus = all(d != "cpu" for d in devices) and len(set(devices)) == world
    if own_gpus and dist.is_nccl_available():
        return "nccl"
    return "gloo"
