"""Aggregation under hostile but valid numbers, through the wire into a real aggregator: no
finite update can make the global model infinite, and a round whose result is not finite
is retried from the previous model instead of being checkpointed and sent out."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from fedgpu.core import codec
from fedgpu.proto import pb, pb_grpc
from tests.fixtures.federation import Federation, job_dir, write_job
from tests.fixtures.wire import Probe, update

GLOBAL = {"w": np.zeros(64, np.float32)}


def start(fed: Federation, tmp: Path, strategy_params: dict[str, float] | None = None,
          **job: Any) -> Path:
    init = tmp / "init.safetensors"
    init.write_bytes(codec.encode(GLOBAL).to_bytes())
    spec: dict[str, Any] = dict(rounds=1, min_nodes=2, round_deadline_s=120, evaluate=False,
                                initial_weights=str(init))
    spec.update(job)
    path = write_job(tmp / "job.toml", **spec)
    if strategy_params:
        with path.open("a") as fh:
            fh.write("\n[strategy_params]\n" + "".join(
                f"{k} = {v}\n" for k, v in strategy_params.items()))
    state = tmp / "state"
    fed.start_server(path, "--state-dir", str(state))
    return state


def rounds_of(fed: Federation, sends: list[list[tuple[float, int]]]) -> list[Any]:
    """Two nodes; in attempt i node j sends all-`value` weights claiming `n` examples."""
    async def go() -> list[Any]:
        async with grpc.aio.insecure_channel(fed.address) as ch:
            stub = pb_grpc.FederationStub(ch)
            nodes = [await Probe(stub, fed.token).register(n) for n in ("a", "b")]
            replies = []
            for attempt in sends:
                for p, (value, n) in zip(nodes, attempt, strict=True):
                    task = await p.task()
                    enc, chunks = update({"w": np.full(64, value, np.float32)})
                    replies.append(await p.push(p.header(task, enc, num_examples=n), chunks))
            return replies
    return asyncio.run(go())


def saved(state: Path) -> dict[str, np.ndarray]:
    tensors, _ = codec.decode((job_dir(state) / "global.safetensors").read_bytes())
    return tensors


def test_huge_values_with_huge_example_counts_stay_finite(federation: Federation,
                                                          tmp_path: Path) -> None:
    state = start(federation, tmp_path)
    replies = rounds_of(federation, [[(1e24, 10**15), (1.0, 1)]])
    assert all(isinstance(r, pb.PushReply) for r in replies), replies
    assert federation.wait_state(("finished", "failed"), timeout=60)["state"] == "finished"
    w = saved(state)["w"]
    assert np.isfinite(w).all()
    np.testing.assert_allclose(w, 1e24, rtol=1e-6)


def test_a_round_whose_result_is_not_finite_is_retried_from_the_previous_model(
        federation: Federation, tmp_path: Path) -> None:
    # FedAvgM with server_lr 2: a mean near float32's largest value steps past it.
    state = start(federation, tmp_path, strategy="fedavgm",
                  strategy_params={"server_lr": 2.0, "momentum": 0.9})
    replies = rounds_of(federation, [[(3e38, 5), (3e38, 5)], [(1.0, 5), (1.0, 5)]])
    assert all(isinstance(r, pb.PushReply) for r in replies), replies
    assert federation.wait_state(("finished", "failed"), timeout=60)["state"] == "finished"
    first, second = federation.query("ListRounds")["rounds"]
    assert first["status"] == "retried" and first["nodes_reporting"] == 2
    assert "tensor 'w' of the aggregate holds NaN or Inf" in first["error"]
    assert "retried from the previous model" in first["error"]
    assert second["status"] == "finished" and "error" not in second
    # From the starting zeros and an untouched velocity: 0 + 2 * (1 - 0) = 2, exactly.
    np.testing.assert_array_equal(saved(state)["w"], np.full(64, 2.0, np.float32))
    assert json.loads((job_dir(state) / "state.json").read_text())["strategy"] == {"steps": 1}
