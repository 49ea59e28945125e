"""How `fedgpu run` spreads its nodes over agent processes, and its demo job's min_nodes."""

from __future__ import annotations

from pathlib import Path

from fedgpu.cli.run.local_nodes import Host, host_cmd, hosts
from fedgpu.cli.run.run_config import LocalRunConfig, demo_job, needed
from fedgpu.core.job import Job, loads_toml, parse_job
from fedgpu.core.job.reader import dumps_job


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
    assert needed(3) == 3
    assert needed(100, 0.1) == 5
    assert needed(12, 0.25) == 1
    assert needed(10, 0.05) == 1
    assert needed(100, 0.1, given=10) == 10
    job = demo_job(nodes=100, fraction=0.1)
    assert (job.fraction, job.min_nodes) == (0.1, 5)


def test_the_run_job_is_a_job_with_the_schemas_defaults() -> None:
    # No second set of defaults: what `fedgpu run` does not set is the schema's (a round's
    # deadline was 300 s here and 600 s in a job file).
    job = demo_job(nodes=2, rounds=3)
    assert job.round_deadline_s == Job(task="digits").round_deadline_s
    assert (job.rounds, job.min_nodes, job.hyperparameters["batch_size"]) == (3, 2, 32)
    assert LocalRunConfig().job == demo_job()
    # The aggregator is handed the job as a file that parses back to the same job.
    ring = demo_job(nodes=4, mode="ring", local_steps=2)
    assert parse_job(loads_toml(dumps_job(ring))) == ring
    assert ring.iterations == 5 * 12


def test_a_task_typo_in_fedgpu_run_gets_the_nearest_task(tmp_path: Path) -> None:
    from tests.fixtures.federation import cli

    r = cli("run", "--task", "digitz", "--nodes", "1", "--run-dir", str(tmp_path / "run"))
    assert r.returncode != 0
    assert "--task 'digitz' is not installed here (did you mean 'digits'?)" in r.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was made
    job = tmp_path / "job.toml"
    job.write_text('task = "digits"\nround = 3\n')
    r = cli("run", "--job", str(job), "--run-dir", str(tmp_path / "r2"))
    assert r.returncode != 0 and "(did you mean 'rounds'?)" in r.stderr, r.stderr
