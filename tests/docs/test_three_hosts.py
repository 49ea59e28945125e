"""The three-hosts tutorial (docs/tutorials/three-hosts.md) runs as written: three sites, each
in a network namespace of its own (its own interface, address and /etc/hosts), start from
their startup kits alone and train a job over mutual TLS, operated with an operator's kit.

It needs root and `ip netns`; the namespaces, links, address and /etc/netns files it makes are
removed whether the page passed or not."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.doc_blocks import ROOT, run_page

PAGE = ROOT / "docs" / "tutorials" / "three-hosts.md"
SITES = ("site-a", "site-b", "site-c")


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _clean() -> None:
    for site in SITES:
        _ip("netns", "del", f"fedgpu-{site}")
        shutil.rmtree(f"/etc/netns/fedgpu-{site}", ignore_errors=True)
        _ip("link", "del", f"fg-{site}")
    _ip("addr", "del", "10.200.0.1/32", "dev", "lo")


def _namespaces_allowed() -> str | None:
    """Why the page cannot run here (None: it can)."""
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) on PATH"
    probe = "fedgpu-probe-netns"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe)
    if "10.200." in _ip("-4", "addr").stdout or _ip("netns", "pids",
                                                    "fedgpu-site-a").returncode == 0:
        return "10.200.0.0/16 or the namespace fedgpu-site-a is in use on this machine"
    return None


@pytest.mark.slow  # an aggregator and three nodes over mutual TLS: ~1-2 min on 2 idle cores
def test_three_hosts_runs_as_written(tmp_path: Path) -> None:
    why = _namespaces_allowed()
    if why is not None:
        pytest.skip(f"the three-hosts tutorial needs network namespaces: {why}")
    try:
        results = run_page(PAGE, tmp_path)
    finally:
        _clean()
    work = tmp_path / "checkout"
    aggregator = (work / "aggregator.log").read_text()
    # Each site registered from its own namespace's address, under its certificate's name.
    for n, site in enumerate(SITES, start=1):
        assert re.search(rf"node {site} registered as {site}-\S+ from ipv4:10\.200\.{n}\.2:",
                         aggregator), aggregator[-3000:]
        log = (work / f"{site}.log").read_text()
        assert "registered with aggregator.fedgpu.test:50051" in log, log[-2000:]
        assert "retired this node" in log
    nodes = next(r for r in results if "fedgpu nodes" in r.block.text).output
    assert all(site in nodes for site in SITES), nodes
    # Each site's key was made at the site, stays private there, and never reached the kits
    # the CA wrote (threat model: the CA's host and the hand-over hold no site key).
    for site in SITES:
        key = work / "hosts" / site / site / "node.key"
        assert key.stat().st_mode & 0o777 == 0o600
        assert not [p for p in (work / "kits").rglob("*") if p.name == "node.key"]
        assert key.read_bytes() not in (work / "kits" / f"{site}.tar.gz").read_bytes()
