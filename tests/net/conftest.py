"""Fixtures of the network suite: a federation of three sites over the emulated WAN."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fedgpu.core import codec
from tests.fixtures.federation import write_job
from tests.net import netns
from tests.net.net_federation import NetFederation
from tests.net.wan_link import WAN


def digits_model(tmp: Path) -> Path:
    """The digits task's initial model as a file (its encoded size is what each download
    carries)."""
    from fedgpu.node.rounds import runner
    from fedgpu.node.rounds.workfiles import WEIGHTS_OUT

    runner.run_round(runner.parse_spec({
        "kind": "init", "task_name": "digits", "hyperparameters": {}, "seed": 0, "round": 0,
        "data_dir": None, "device": "cpu", "torch_threads": 1}), tmp)
    path = tmp / "init.safetensors"
    path.write_bytes(codec.encode(codec.read_file(tmp / WEIGHTS_OUT)).to_bytes())
    return path


@pytest.fixture(scope="module", name="wan")
def wan_fixture(tmp_path_factory: pytest.TempPathFactory,
                digits_split: list[Path]) -> Iterator[NetFederation]:
    """The aggregator and three sites, each site behind its own 100 ms / 1% loss / 50 Mbit/s
    link, running one long digits job that the module's scenarios share round by round."""
    if reason := netns.skip_reason():
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("wan")
    init = digits_model(tmp)
    # Short rounds; min_nodes 2 so a partitioned site leaves a round that can still close; a
    # deadline long enough for a cut and its resume, short enough to bound a stuck round.
    job = write_job(tmp / "job.toml", rounds=60, min_nodes=2, round_deadline_s=25,
                    evaluate=False, round_retries=3, initial_weights=str(init),
                    hyperparameters={"lr": 0.05, "local_epochs": 1})
    with netns.topology(3) as top:
        fed = NetFederation(tmp, top, WAN)
        try:
            # Heartbeats every 2 s: a site is lost after 3 missed ones + 2 s (8 s), which the
            # partition scenario outlasts.
            fed.start_server(job, "--state-dir", str(tmp / "state"), "--heartbeat-s", "2")
            for i in range(3):
                fed.start_site(i, digits_split[i])
            yield fed
        finally:
            fed.stop()
