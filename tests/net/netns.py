"""Network namespaces for the network suite: the aggregator in one, each site in its own, each
joined to the root namespace by a veth pair. Nothing routes between them: the only way from a
site to the aggregator is the WAN emulator (tests/net/wan_link.py), which runs in the root
namespace, listens on the root end of the site's veth and connects to the aggregator's.

    site-1 ns  10.N.1.2 --veth-- 10.N.1.1  root ns: wan_link relays --veth-- 10.N.0.2 aggregator ns
    site-2 ns  10.N.2.2 --veth-- 10.N.2.1            (one Link per site)

Names carry the test process's pid, so two runs on one machine never share a namespace, and
every namespace is deleted at the end, whatever happened (deleting a namespace deletes its
end of each veth pair and so the pair). Needs root and iproute2; `skip_reason()` says why not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20,
                          check=check)


def skip_reason() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "the network suite needs iproute2's `ip` (not installed)"
    if os.geteuid() != 0:
        return "the network suite makes network namespaces: it needs root (CI runs as root)"
    probe = f"fgprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class End:
    """One namespace and its veth pair to the root namespace."""
    ns: str
    ip: str          # the namespace's address
    root_ip: str     # the root namespace's end: where the WAN emulator listens for it
    veth: str        # the root end's interface name (tc applies to what leaves through it)
    veth_ns: str     # the namespace's end

    def exec(self, *argv: str) -> list[str]:
        """argv run inside this namespace (`ip netns exec` execs: the pid is the program's)."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def shape(self, rate: str) -> None:
        """Limit both directions of this veth to `rate` (tc tbf, e.g. '2mbit'): downloads as
        they leave the root end, uploads as they leave the namespace's end."""
        tbf = ["tbf", "rate", rate, "burst", "16kb", "latency", "400ms"]
        for prefix, dev in (([], self.veth), (["ip", "netns", "exec", self.ns], self.veth_ns)):
            subprocess.run([*prefix, "tc", "qdisc", "replace", "dev", dev, "root", *tbf],
                           check=True, capture_output=True, timeout=20)

    def unshape(self) -> None:
        for prefix, dev in (([], self.veth), (["ip", "netns", "exec", self.ns], self.veth_ns)):
            subprocess.run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, timeout=20)


@dataclass
class Topology:
    tag: str
    aggregator: End
    sites: list[End] = field(default_factory=list)


def _end(tag: str, name: str, subnet: str, index: int, made: list[End]) -> End:
    ns = f"{tag}{name}"
    # Interface names are at most 15 characters: tag (<= 9) + name (1-2) + r/n.
    end = End(ns, f"{subnet}.{index}.2", f"{subnet}.{index}.1", f"{tag}{name}r",
              f"{tag}{name}n")
    made.append(end)  # removed at the end even when a step below fails
    _ip("netns", "add", ns)
    _ip("link", "add", end.veth, "type", "veth", "peer", "name", end.veth_ns, "netns", ns)
    _ip("addr", "add", f"{end.root_ip}/24", "dev", end.veth)
    _ip("link", "set", end.veth, "up")
    _ip("-n", ns, "addr", "add", f"{end.ip}/24", "dev", end.veth_ns)
    _ip("-n", ns, "link", "set", end.veth_ns, "up")
    _ip("-n", ns, "link", "set", "lo", "up")
    return end


def _remove(end: End) -> None:
    # Processes the suite started there and left running (a failed test): ended by pid.
    pids = _ip("netns", "pids", end.ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", end.ns, check=False)
    _ip("link", "del", end.veth, check=False)  # gone with the namespace, unless that failed


@contextlib.contextmanager
def topology(sites: int) -> Iterator[Topology]:
    """An aggregator namespace and `sites` site namespaces, removed at the end."""
    pid = os.getpid()
    tag = f"fg{pid % 1_000_000}"
    subnet = f"10.{200 + pid % 50}"  # unlikely to meet a real 10/8 route; /24s under it
    made: list[End] = []
    try:
        top = Topology(tag, _end(tag, "a", subnet, 0, made))
        for i in range(1, sites + 1):
            top.sites.append(_end(tag, f"s{i}", subnet, i, made))
        yield top
    finally:
        for end in made:
            _remove(end)
