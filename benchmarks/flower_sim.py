"""Flower's side of benchmarks/many_clients.py: the same federation in Flower's simulation.

Runs in .venv-bench (Flower with its Ray backend, `flwr[simulation]`). Clients train fedgpu's own
digits task code (`fedgpu.node.tasks.digits.DigitsTask`: the same model, the same loop, the same
hyperparameters) on the same per-client partitions, so the comparison is of the frameworks, not
of two models. FedAvg weighted by examples, `per_round` clients sampled each round, no federated
evaluation (the final model is scored by the caller, with the same code for both sides).

    .venv-bench/bin/python -m benchmarks.flower_sim --split DIR --clients 100 --per-round 10 \\
        --rounds 5 --out final.npz [--device cuda --gpu-share 0.1]

On a GPU (not run yet: the machines this was written on had none) clients take `--gpu-share`
of the card each (Ray's fractional `num_gpus`) and the server reads NVML after every round,
while no client trains: what the idle clients still hold.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

HP = {"lr": 0.05, "momentum": 0.9, "local_epochs": 1, "batch_size": 32}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--split", type=Path, required=True)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpus", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--gpu-share", type=float, default=0.1)
    a = ap.parse_args()

    import numpy as np
    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    from fedgpu.node.tasks.digits import DigitsTask

    split = a.split.resolve()
    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)  # as fedgpu's nodes train (`fedgpu run --torch-threads 1`)
        device = torch.device(a.device)  # Ray sets CUDA_VISIBLE_DEVICES for its share
        task = DigitsTask()
        pid = int(context.node_config["partition-id"])
        model = task.build_model(HP)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        model.to(device)
        data = {k: v.to(device) for k, v in task.load_data(split / f"node-{pid + 1}").items()}
        server_round = int(msg.content["config"].get("server-round", 0))
        n, metrics = task.train(model, data, device, HP, seed=1000 * server_round + pid)
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                              "metrics": MetricRecord({"num-examples": n, **metrics})})
        return Message(content=content, reply_to=msg)

    server = ServerApp()
    final: dict[str, object] = {}
    gpu_after: list[int | None] = []

    def after_round(server_round: int, _arrays: ArrayRecord) -> None:
        # Called by the strategy after each round's aggregation, while no client trains.
        gpu_after.append(_gpu_used_mib())

    @server.main()
    def main_(grid: Grid, context: Context) -> None:
        torch.manual_seed(0)
        model = DigitsTask().build_model(HP)
        strategy = FedAvg(fraction_train=a.per_round / a.clients, fraction_evaluate=0.0,
                          min_train_nodes=a.per_round, min_evaluate_nodes=0,
                          min_available_nodes=a.clients)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                                num_rounds=a.rounds,
                                evaluate_fn=after_round if a.device == "cuda" else None)
        final["state"] = result.arrays.to_torch_state_dict()

    started = time.perf_counter()
    gpus = a.gpu_share if a.device == "cuda" else 0.0
    run_simulation(server_app=server, client_app=client, num_supernodes=a.clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": gpus},
                                   "init_args": {"num_cpus": a.cpus,
                                                 "num_gpus": 1 if gpus else 0}})
    seconds = time.perf_counter() - started
    state = final.get("state")
    if state is None:
        raise SystemExit("Flower's simulation ended without a final model")
    np.savez(a.out, **{k: v.detach().cpu().numpy() for k, v in state.items()})  # type: ignore[union-attr]
    # Index 0 is the initial model, before any client ran.
    print(json.dumps({"impl": "flower", "simulation_s": round(seconds, 2),
                      "gpu_used_after_round_mib": gpu_after}), flush=True)


def _gpu_used_mib(index: int = 0) -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(
                pynvml.nvmlDeviceGetHandleByIndex(index)).used) >> 20
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML here: nothing to report
        return None


if __name__ == "__main__":
    main()
