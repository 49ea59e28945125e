"""A federation over an emulated WAN: the real aggregator in its network namespace, real node
agents each in their site's namespace, and one wan_link.Link per site in the root namespace
relaying the site's gRPC and bulk connections to the aggregator (tests/net/netns.py draws it).

The test itself reaches the aggregator directly (admin queries over the aggregator's veth),
never through a site's link, so its queries neither cross the emulated WAN nor count in a
site's bytes.
"""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

from tests.fixtures.federation import FEDGPU, ROOT, Federation, Proc, base_env, free_port
from tests.net.netns import End, Topology
from tests.net.wan_link import Link, Profile

# Heartbeats every second: a site is lost after 3 missed ones + 2 s (server/registry.py).
HEARTBEAT_S = 1
LOST_AFTER_S = 3 * HEARTBEAT_S + 2
# A node's line for a round it trained: "round 4 train done in 1.2s: ..." (node/agent.py).
TRAINED = re.compile(r"round (\d+) train done in")


class NetFederation(Federation):
    def __init__(self, tmp: Path, top: Topology, profile: Profile) -> None:
        super().__init__(tmp)
        self.top = top
        self.links = [Link(profile, seed=i) for i in range(len(top.sites))]
        self.port = free_port()
        self.bulk_port = free_port()
        self._server_args: list[str] = []

    def spawn_in(self, end: End, name: str, args: list[str]) -> Proc:
        log = self.tmp / f"{name}.log"
        fh = open(log, "ab")  # noqa: SIM115 - owned by the child; appended across restarts
        env = base_env(FEDGPU_TOKEN=self.token, FEDGPU_NODE_STATE=str(self.tmp / "node-state"))
        p = subprocess.Popen(end.exec(*FEDGPU, *args), stdout=fh, stderr=subprocess.STDOUT,
                             env=env, cwd=ROOT)
        proc = Proc(name, p, log)
        self.procs.append(proc)
        return proc

    def start_server(self, job: Path | None, *extra: str, port: int | None = None,
                     env: dict[str, str] | None = None) -> Proc:
        agg = self.top.aggregator
        self.address = f"{agg.ip}:{self.port}"
        self._server_args = [
            "server", "start", *(["--job", str(job)] if job is not None else []),
            "--host", agg.ip, "--port", str(self.port), "--bulk-port", str(self.bulk_port),
            *extra]
        proc = self.spawn_in(agg, "aggregator", self._server_args)
        self.wait_healthy(proc)
        # Each site reaches the aggregator's two ports at the root end of its own veth.
        for link, site in zip(self.links, self.top.sites, strict=True):
            for label, p in (("grpc", self.port), ("bulk", self.bulk_port)):
                if not any(r.label == label for r in link.relays):
                    link.relay(label, (site.root_ip, p), (agg.ip, p))
        return proc

    def kill_server(self) -> None:
        """SIGKILL: no goodbye, no flush; what it held in memory is gone."""
        for old in (p for p in self.procs if p.name == "aggregator"):
            if old.popen.poll() is None:
                old.popen.send_signal(signal.SIGKILL)
                old.popen.wait(timeout=10)
        self.procs = [p for p in self.procs if p.name != "aggregator"]

    def restart_server(self) -> Proc:
        self.kill_server()
        proc = self.spawn_in(self.top.aggregator, "aggregator", self._server_args)
        self.wait_healthy(proc)
        return proc

    def start_site(self, index: int, data: Path, *extra: str) -> Proc:
        site = self.top.sites[index]
        name = f"site-{index + 1}"
        return self.spawn_in(site, name, [
            "node", "start", "--aggregator", f"{site.root_ip}:{self.port}", "--data",
            str(data), "--name", name, "--torch-threads", "1",
            "--status-file", str(self.tmp / f"{name}.status"), *extra])

    def log(self, index: int) -> str:
        path = self.tmp / f"site-{index + 1}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def trained(self, index: int) -> list[int]:
        """The rounds site `index` trained, one entry per training, from its own log."""
        return [int(m) for m in TRAINED.findall(self.log(index))]

    def stop(self) -> None:
        # All at once (SIGTERM, then SIGKILL after 10 s): one by one, each waits its turn.
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        for p in self.procs:
            p.stop()
        for link in self.links:
            link.close()
