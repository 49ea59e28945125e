"""Flower's central DP (`DifferentialPrivacyServerSideFixedClipping` around FedAvg) in its
simulation: the other side of benchmarks/dp_utility.py's client-level rows.

Runs in .venv-bench (`flwr[simulation]`). The same digits split, initial model, hyperparameters,
per-node-round seeds, clip and noise multiplier as fedgpu's row; every client in every round;
equal client weights (Flower's accounted path requires them, and fedgpu's central mode weighs
every node the same); Flower's own RDP accountant, with no amplification by sampling (all
clients take part), reports epsilon at delta.

    .venv-bench/bin/python -m benchmarks.flower_dp --split DIR --init init.npz --nodes 10 \\
        --rounds 10 --noise 2.02 --clip 1 --out final.npz

Prints one JSON line: epsilon spent by Flower's account and the simulation's seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# benchmarks/dp_utility.py HP: the digits task's own loop, momentum 0.9 by its default.
HP = {"lr": 0.1, "local_epochs": 2, "batch_size": 32}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--split", type=Path, required=True)
    ap.add_argument("--init", type=Path, required=True)
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--noise", type=float, required=True)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    import numpy as np
    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
    from flwr.simulation import run_simulation
    from flwr.supercore.privacy_accounting import (
        NeighboringRelation,
        PrivacyConfig,
        SamplingMethod,
    )
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

    from fedgpu.node.tasks.digits import DigitsTask

    split = a.split.resolve()
    init = {k: torch.from_numpy(v) for k, v in np.load(a.init).items()}
    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        task = DigitsTask()
        pid = int(context.node_config["partition-id"])
        model = task.build_model(HP)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        data = task.load_data(split / f"node-{pid + 1}")
        number = int(msg.content["config"].get("server-round", 0))
        # dp_utility's seed for node i in round r: seed * 1000 + r * 10 + i.
        _, metrics = task.train(model, data, torch.device("cpu"), HP,
                                seed=a.seed * 1000 + number * 10 + pid)
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                              "metrics": MetricRecord({"num-examples": 1,
                                                       "loss": metrics["loss"]})})
        return Message(content=content, reply_to=msg)

    server = ServerApp()
    final: dict[str, object] = {}

    @server.main()
    def main_(grid: Grid, context: Context) -> None:
        accountant = RdpAccountant(PrivacyConfig(
            target_delta=a.delta, population_size=a.nodes,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.NO_AMPLIFICATION))
        inner = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=a.nodes,
                       min_evaluate_nodes=0, min_available_nodes=a.nodes)
        strategy = DifferentialPrivacyServerSideFixedClipping(
            inner, noise_multiplier=a.noise, clipping_norm=a.clip,
            num_sampled_clients=a.nodes, accountant=accountant)
        # In the model's own key order: Flower pairs updates with the model by position.
        model = DigitsTask().build_model(HP)
        model.load_state_dict(init)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                                num_rounds=a.rounds)
        final["state"] = result.arrays.to_torch_state_dict()
        final["epsilon"] = accountant.get_privacy_spent().epsilon

    started = time.perf_counter()
    run_simulation(server_app=server, client_app=client, num_supernodes=a.nodes,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": a.cpus, "num_gpus": 0}})
    seconds = time.perf_counter() - started
    state = final.get("state")
    if state is None:
        raise SystemExit("Flower's simulation ended without a final model")
    np.savez(a.out, **{k: v.detach().cpu().numpy() for k, v in state.items()})  # type: ignore[union-attr]
    print(json.dumps({"impl": "flower-central-dp", "epsilon": final["epsilon"],
                      "simulation_s": round(seconds, 2)}), flush=True)


if __name__ == "__main__":
    main()
