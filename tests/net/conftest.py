"""Fixtures of the network suite: a federation of three sites over the emulated WAN."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.federation import cli, write_job
from tests.net import netns
from tests.net.net_federation import HEARTBEAT_S, NetFederation
from tests.net.records import wait_for
from tests.net.wan_link import WAN


@pytest.fixture(scope="module", name="wan")
def wan_fixture(tmp_path_factory: pytest.TempPathFactory,
                digits_split: list[Path]) -> Iterator[NetFederation]:
    """The aggregator and three sites, each site behind its own 100 ms / 1% loss / 50 Mbit/s
    link, running one long digits job that the module's scenarios share round by round."""
    if reason := netns.skip_reason():
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("wan")
    # Short rounds; min_nodes 2 so a partitioned site leaves a round that can still close; a
    # deadline long enough for a cut and its resume, short enough to bound a stuck round.
    job = write_job(tmp / "job.toml", rounds=60, min_nodes=2, round_deadline_s=25,
                    evaluate=False, round_retries=3,
                    hyperparameters={"lr": 0.05, "local_epochs": 1})
    with netns.topology(3) as top:
        fed = NetFederation(tmp, top, WAN)
        try:
            fed.start_server(None, "--state-dir", str(tmp / "state"),
                             "--heartbeat-s", str(HEARTBEAT_S))
            for i in range(3):
                fed.start_site(i, digits_split[i])
            # The job once every site has its training stack loaded (a torch import takes
            # seconds on a busy CI machine): a first round then never waits on an import.
            wait_for(lambda: all("worker factory ready" in fed.log(i) for i in range(3)), 120,
                     "the sites' training stacks")
            r = cli("job", "submit", str(job), "--address", fed.address)
            assert r.returncode == 0, r.stderr
            yield fed
        finally:
            fed.stop()
