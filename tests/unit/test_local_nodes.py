"""How `fedgpu run` spreads its nodes over agent processes, and its demo job's min_nodes."""

from __future__ import annotations

from pathlib import Path

from fedgpu.cli.run.launcher import LocalRunConfig, _job_toml, min_nodes
from fedgpu.cli.run.local_nodes import Host, host_cmd, hosts


def test_nodes_are_spread_evenly_over_as_few_processes_as_allowed() -> None:
    assert hosts(3, 50) == [Host(1, 3)]
    assert hosts(100, 50) == [Host(1, 50), Host(51, 50)]
    assert [h.count for h in hosts(101, 50)] == [34, 34, 33]
    spread = hosts(12, 6)
    assert [(h.first, h.count) for h in spread] == [(1, 6), (7, 6)]
    assert [h.name for h in spread] == ["nodes-1-6", "nodes-7-12"]
    assert hosts(1, 50)[0].name == "nodes-1"


def test_each_host_gets_its_ring_ports_and_the_shared_factory() -> None:
    cmd = host_cmd(Host(3, 2), address="127.0.0.1:1", split=Path("/s"), socket=Path("/f.sock"),
                   logs=Path("/l"), gpu="none", torch_threads=1, gpu_memory_fraction=0.25,
                   ring_ports=[11, 12, 13, 14, 15])
    assert cmd[cmd.index("--first") + 1] == "3" and cmd[cmd.index("--count") + 1] == "2"
    assert cmd[cmd.index("--ring-ports") + 1] == "13,14"
    assert cmd[cmd.index("--worker-factory") + 1] == "/f.sock"
    assert cmd[cmd.index("--gpu-memory-fraction") + 1] == "0.25"


def test_min_nodes_is_every_node_or_half_of_those_sampled() -> None:
    assert min_nodes(LocalRunConfig(nodes=3)) == 3
    assert min_nodes(LocalRunConfig(nodes=100, fraction=0.1)) == 5
    assert min_nodes(LocalRunConfig(nodes=12, fraction=0.25)) == 1
    assert min_nodes(LocalRunConfig(nodes=10, fraction=0.05)) == 1
    assert min_nodes(LocalRunConfig(nodes=100, fraction=0.1, min_nodes=10)) == 10
    job = _job_toml(LocalRunConfig(nodes=100, fraction=0.1))
    assert "fraction = 0.1\n" in job and "min_nodes = 5\n" in job
