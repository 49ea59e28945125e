"""One block of D-PSGD iterations: `python -m fedgpu.node.ring_worker WORKDIR`, a
torch.distributed worker.

Spawned per block like a star round (node/rounds/process.py), so GPU memory goes back to the driver
after every block and NVML accounting per block works as in star mode. Between blocks this
node's own copy of the model, and its optimizer state, persist in the ring state directory the
agent names (`copy.safetensors`, tagged with the run and the iteration it reached); the
aggregator says `restart` when everyone must start again from the averaged model it sends.

task.json is the star contract plus a "ring" section (see node/ring.py); out come result.json
(with "iteration_loss") and weights.out.safetensors holding this node's copy, which the
aggregator averages into the block's model and uses for the consensus distance.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fedgpu.core import codec, lifetime
from fedgpu.node import gossip, weights
from fedgpu.node.rounds import round_device, runner
from fedgpu.node.rounds.runner import BadInputError, DivergedError, RoundResult, RoundSpec
from fedgpu.node.rounds.worker import _fail
from fedgpu.node.rounds.workfiles import (
    EXIT_OK,
    RESULT_FILE,
    TASK_FILE,
    WEIGHTS_IN,
    WEIGHTS_OUT,
    write_json,
)
from fedgpu.node.tasks.base import RingTask

log = logging.getLogger("fedgpu.ring_worker")

COPY_FILE = "copy.safetensors"
_OPT = "__optimizer__/"


@dataclass(frozen=True)
class RingSpec:
    run_id: str
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    first_iteration: int
    iterations: int
    total_iterations: int
    local_steps: int
    mixing: np.ndarray
    peers: list[str]
    restart: bool
    timeout_s: float
    state_dir: Path
    gpu_uuid: str

    @classmethod
    def parse(cls, raw: object) -> RingSpec:
        if not isinstance(raw, Mapping):
            raise BadInputError("task.json: 'ring' must be an object")
        try:
            n = int(raw["world_size"])
            w = np.asarray(raw["mixing"], dtype=np.float64)
            if w.size != n * n:
                raise BadInputError(f"task.json: ring mixing has {w.size} entries for "
                                    f"world size {n}")
            return cls(
                run_id=str(raw["run_id"]), rank=int(raw["rank"]), world_size=n,
                master_addr=str(raw["master_addr"]), master_port=int(raw["master_port"]),
                first_iteration=int(raw["first_iteration"]), iterations=int(raw["iterations"]),
                total_iterations=int(raw["total_iterations"]),
                local_steps=int(raw["local_steps"]), mixing=w.reshape(n, n),
                peers=[str(p) for p in raw["peers"]], restart=bool(raw["restart"]),
                timeout_s=float(raw["timeout_s"]), state_dir=Path(raw["state_dir"]),
                gpu_uuid=str(raw.get("gpu_uuid") or ""),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise BadInputError(f"task.json: bad 'ring' section: {exc}") from None


def run_block(spec: RoundSpec, ring: RingSpec, workdir: Path) -> dict[str, Any]:
    device = round_device.prepare_device(spec)
    # Per rank, so dropout and any other randomness differ between the copies.
    round_device.seed_everything(spec.seed * 1009 + ring.rank)
    task = runner.task_for(spec, workdir)
    if not isinstance(task, RingTask):
        raise BadInputError(f"task {spec.task_name!r} cannot run in ring mode: it needs "
                            "optimizer, batch_size, train_size and batch_loss (RingTask in "
                            "node/tasks/base.py)")
    if spec.data_dir is None:
        raise BadInputError("task.json: 'data_dir' is required for a ring block")
    hp = spec.hyperparameters
    result = RoundResult(device_name=round_device.device_name(device))
    with torch.device(device):
        model = task.build_model(hp)
    averaged = weights.read_arrays(workdir / WEIGHTS_IN)
    wire = {name: codec.dtype_name(arr.dtype) for name, arr in averaged.items()}
    weights.load_into(model, averaged)
    del averaged
    data = {k: v.to(device) for k, v in task.load_data(spec.data_dir).items()}
    # The payload is the previous block's averaged model: scored here like star mode scores
    # the global model, on this node's held-out split.
    result.num_eval_examples, result.eval_metrics = task.evaluate(model, data, device, hp)
    opt = task.optimizer(model, hp)
    copy_path = ring.state_dir / COPY_FILE
    if not ring.restart:
        _load_copy(copy_path, model, opt, ring)

    losses, correct, seen, stats = _train(task, model, opt, data, device, hp, ring, spec.seed)
    result.train_seconds = stats.pop("seconds")
    bad = weights.non_finite(model)
    if bad:
        raise DivergedError(f"training diverged: {len(bad)} tensor(s) hold NaN/inf (first: "
                            f"{bad[0]}); lower 'lr' in the job's hyperparameters")
    end = ring.first_iteration + ring.iterations
    if end >= ring.total_iterations:
        # The run's last block: the averaged model is the output, this copy is not needed.
        copy_path.unlink(missing_ok=True)
    else:
        _save_copy(copy_path, model, opt, ring, end)
    weights.write_weights(workdir / WEIGHTS_OUT, weights.state_arrays(model, wire),
                          {"task": spec.task_name, "round": str(spec.round)})
    result.num_examples = task.train_size(data)
    result.train_metrics = {
        "loss": float(sum(losses) / max(len(losses), 1)),
        "accuracy": correct / max(seen, 1),
        **stats,
    }
    if device.type == "cuda":
        mib = round_device.ceil_mib
        result.torch_peak_allocated_mib = mib(torch.cuda.max_memory_allocated(device))
        result.torch_peak_reserved_mib = mib(torch.cuda.max_memory_reserved(device))
    result.rss_peak_mib = round_device.rss_peak_mib()
    return {**result.to_dict(), "iteration_loss": losses}


def _train(task: RingTask, model: torch.nn.Module, opt: torch.optim.Optimizer,
           data: Mapping[str, torch.Tensor], device: torch.device, hp: Mapping[str, Any],
           ring: RingSpec, seed: int) -> tuple[list[float], int, int, dict[str, float]]:
    timeout = datetime.timedelta(seconds=ring.timeout_s)
    try:
        store = gossip.store_of(ring.master_addr, ring.master_port, ring.world_size, ring.rank,
                                ring.timeout_s)
    except (RuntimeError, dist.DistStoreError) as exc:
        where = f"{ring.master_addr}:{ring.master_port}"
        if ring.rank == 0:
            raise gossip.PeerLost(f"cannot host the ring rendezvous on port {ring.master_port} "
                                  f"(--ring-port): {exc}", []) from None
        raise gossip.PeerLost(f"ring lost rank 0 ({ring.peers[0]}): its rendezvous at {where} "
                              f"did not answer within {ring.timeout_s:g}s: {exc}", [0]) from None
    liveness = gossip.Liveness(ring.master_addr, ring.master_port, ring.world_size, ring.rank,
                               ring.timeout_s)
    outcome = "error: the block did not finish"
    try:
        try:
            dist.init_process_group("gloo", store=dist.PrefixStore("pg", store),
                                    rank=ring.rank, world_size=ring.world_size, timeout=timeout)
            backend = gossip.choose_backend(store, ring.rank, ring.world_size,
                                            ring.gpu_uuid if device.type == "cuda" else "cpu")
            group = dist.new_group(backend="nccl", timeout=timeout) if backend == "nccl" else None
        except (RuntimeError, dist.DistError) as exc:
            lost = liveness.lost()
            names = ", ".join(f"rank {r} ({ring.peers[r]})" for r in lost) or "a peer"
            raise gossip.PeerLost(f"ring rendezvous failed, missing {names}: "
                                  f"{' '.join(str(exc).split())[:300]}", lost) from None
        log.info("rank %d of %d joined the ring (%s) at %s:%d; iterations %d..%d",
                 ring.rank, ring.world_size, backend, ring.master_addr, ring.master_port,
                 ring.first_iteration, ring.first_iteration + ring.iterations - 1)
        net = gossip.Ring(ring.rank, ring.mixing, ring.timeout_s, ring.peers, backend, group,
                          liveness)
        # Parameters and float buffers (e.g. batch-norm statistics) are all part of the copy.
        shared = [t for t in model.state_dict().values() if t.is_floating_point()]
        bs = task.batch_size(hp)
        n = task.train_size(data)
        per_epoch = math.ceil(n / bs)
        losses: list[torch.Tensor] = []
        correct = torch.zeros((), dtype=torch.int64, device=device)
        seen = 0
        order, order_epoch = None, -1
        start = time.perf_counter()
        for k in range(ring.first_iteration, ring.first_iteration + ring.iterations):
            epoch, pos = divmod(k, per_epoch)
            if epoch != order_epoch:
                # Seeded by rank and epoch alone, so the batch sequence is the same whether the
                # iterations run in one block or many.
                gen = torch.Generator(device=device).manual_seed(
                    seed * 1_000_003 + ring.rank * 7919 + epoch)
                order, order_epoch = torch.randperm(n, generator=gen, device=device), epoch
            assert order is not None
            idx = order[pos * bs:(pos + 1) * bs]
            loss, right = task.batch_loss(model, data, idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if (k + 1) % ring.local_steps == 0:
                # D-PSGD: x <- W x between computing the gradient at x and applying it.
                flat = gossip.flat_params(shared)
                net.mix_(flat)
                gossip.unflatten_(flat, shared)
            opt.step()
            losses.append(loss.detach())
            correct += right
            seen += len(idx)
        # Nobody leaves (closing connections) while a neighbour still waits on it.
        try:
            dist.barrier()
        except RuntimeError as exc:
            raise net.lost_error(-1, exc) from None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = round(time.perf_counter() - start, 4)
        outcome = "ok"
    except gossip.PeerLost:
        outcome = "peer"
        raise
    except BaseException as exc:
        outcome = f"error: {type(exc).__name__}: {exc}"[:200]
        raise
    finally:
        liveness.stop(outcome)
        gossip.leave(liveness, outcome != "ok",
                     min(ring.timeout_s, 60.0) + 2 * gossip.LOST_WINDOW_S)
    stats = {
        "seconds": seconds,
        "bytes_sent": float(net.bytes_sent),
        "bytes_sent_per_iteration": net.bytes_sent / max(ring.iterations, 1),
        "exchanges": float(net.exchanges),
        "comm_seconds": round(net.comm_seconds, 4),
        "nccl": 1.0 if backend == "nccl" else 0.0,
    }
    return [float(v) for v in torch.stack(losses).tolist()], int(correct), seen, stats


def _save_copy(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, ring: RingSpec,
               iteration: int) -> None:
    arrays = dict(weights.state_arrays(model))
    names = {id(p): name for name, p in model.named_parameters()}
    for p, state in opt.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                arrays[f"{_OPT}{names[id(p)]}/{key}"] = weights.to_numpy(value)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    # Renamed into place: a worker killed mid-write leaves the previous copy, never half of one.
    weights.write_weights(tmp, arrays, {"run_id": ring.run_id, "iteration": str(iteration),
                                        "rank": str(ring.rank)})
    os.replace(tmp, path)


def _load_copy(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
               ring: RingSpec) -> None:
    try:
        arrays, meta = codec.decode(bytearray(path.read_bytes()))
    except FileNotFoundError:
        raise BadInputError(f"no local copy of the model at {path} to continue block at "
                            f"iteration {ring.first_iteration}; the aggregator restarts the "
                            "ring from the averaged model") from None
    if meta.get("run_id") != ring.run_id or meta.get("iteration") != str(ring.first_iteration):
        raise BadInputError(f"local copy {path} is of run {meta.get('run_id')} at iteration "
                            f"{meta.get('iteration')}, not run {ring.run_id} at "
                            f"{ring.first_iteration}; the aggregator restarts the ring from "
                            "the averaged model")
    weights.load_into(model, {k: v for k, v in arrays.items() if not k.startswith(_OPT)})
    params = dict(model.named_parameters())
    for key, arr in arrays.items():
        if key.startswith(_OPT):
            pname, _, skey = key[len(_OPT):].rpartition("/")
            p = params[pname]
            opt.state[p][skey] = weights.to_torch(np.array(arr)).to(p.device)


def run(workdir: Path) -> int:
    try:
        raw = json.loads((workdir / TASK_FILE).read_text())
        spec = runner.parse_spec(raw)
        ring = RingSpec.parse(raw.get("ring"))
        out = run_block(spec, ring, workdir)
    except gossip.PeerLost as exc:
        # The message names the lost rank; a traceback of ours would only distract from it.
        return _fail(workdir, "exception", str(exc), lost_ranks=exc.lost)
    except Exception as exc:
        failure = runner.classify(exc)
        return _fail(workdir, failure.kind, failure.message, exc, failure.exit_code)
    write_json(workdir / RESULT_FILE, out)
    log.info("ring block done: iterations %d..%d, loss %.4f, sent %d bytes",
             ring.first_iteration, ring.first_iteration + ring.iterations - 1,
             out["train_metrics"]["loss"], int(out["train_metrics"]["bytes_sent"]))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The agent that started us may be SIGKILLed: then we stop too, instead of training on
    # for nobody (and holding the GPU).
    lifetime.bind_to_parent()
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m fedgpu.node.ring_worker WORKDIR", file=sys.stderr)
        return 2
    return run(Path(args[0]))


if __name__ == "__main__":
    # Every output is a file by now (lifetime.exit_now says why not the usual exit).
    lifetime.exit_now(main())
