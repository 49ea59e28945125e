"""Flower's SecAgg+ (`SecAggPlusWorkflow` + `secaggplus_mod`) in its simulation: the other side
of benchmarks/secagg_overhead.py, for the same K and model sizes.

Runs in .venv-bench (`flwr[simulation]`). Clients return a synthetic update of the model's
shapes (no training: the comparison is of the aggregation protocols), FedAvg weighted by
examples, every client in every round. Each round is timed from the strategy's configure_fit
(before the protocol's first stage) to its aggregate_fit (after unmasking).

    .venv-bench/bin/python -m benchmarks.flower_secagg --clients 10 --params 1000000 \\
        --rounds 3 [--plain] [--num-shares 1.0 --threshold 0.5]

Prints one JSON line: the per-round seconds.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--params", type=int, default=1_000_000)
    ap.add_argument("--tensors", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plain", action="store_true", help="FedAvg without SecAgg+")
    ap.add_argument("--num-shares", type=float, default=1.0,
                    help="SecAgg+ neighbours: a fraction of the clients, or a count")
    ap.add_argument("--threshold", type=float, default=0.5,
                    help="reconstruction threshold: a fraction of num-shares, or a count")
    ap.add_argument("--cpus", type=int, default=2)
    a = ap.parse_args()

    import numpy as np
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import Context, ndarrays_to_parameters
    from flwr.server import LegacyContext, ServerApp, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.simulation import run_simulation

    each = a.params // a.tensors
    sizes = [each] * (a.tensors - 1) + [a.params - each * (a.tensors - 1)]
    rng = np.random.default_rng(0)
    model = [(rng.standard_normal(n) * 0.05).astype(np.float32) for n in sizes]

    class Client(NumPyClient):
        def __init__(self, pid: int) -> None:
            self.pid = pid

        def fit(self, parameters, config):  # noqa: ANN001, ANN201
            step = np.float32(0.001 * (1 + self.pid % 7))
            return [p + step for p in parameters], 10 + self.pid % 90, {}

        def evaluate(self, parameters, config):  # noqa: ANN001, ANN201
            return 0.0, 1, {}

    def client_fn(context: Context):  # noqa: ANN202
        return Client(int(context.node_config["partition-id"])).to_client()

    client = ClientApp(client_fn=client_fn, mods=[] if a.plain else [secaggplus_mod])
    times: list[float] = []

    class TimedFedAvg(FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):  # noqa: ANN001, ANN201
            self._t0 = time.perf_counter()
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round, results, failures):  # noqa: ANN001, ANN201
            out = super().aggregate_fit(server_round, results, failures)
            times.append(time.perf_counter() - self._t0)
            return out

    server = ServerApp()

    @server.main()
    def main_(grid, context: Context) -> None:  # noqa: ANN001
        strategy = TimedFedAvg(fraction_fit=1.0, fraction_evaluate=0.0,
                               min_fit_clients=a.clients, min_available_clients=a.clients,
                               initial_parameters=ndarrays_to_parameters(model))
        ctx = LegacyContext(context=context, config=ServerConfig(num_rounds=a.rounds),
                            strategy=strategy)
        num_shares = int(a.num_shares) if a.num_shares > 1 else a.num_shares
        threshold = int(a.threshold) if a.threshold > 1 else a.threshold
        fit = None if a.plain else SecAggPlusWorkflow(
            num_shares=num_shares, reconstruction_threshold=threshold, max_weight=100)
        workflow = DefaultWorkflow(fit_workflow=fit) if fit is not None else DefaultWorkflow()
        workflow(grid, ctx)

    start = time.perf_counter()
    run_simulation(server_app=server, client_app=client, num_supernodes=a.clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": a.cpus}})
    print(json.dumps({"framework": "flower", "secure": not a.plain, "clients": a.clients,
                      "params": a.params, "round_s": [round(t, 3) for t in times],
                      "run_s": round(time.perf_counter() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
