"""The compose deployment, run for real on a Docker engine.

Skips (with the reason) when no engine answers; `bash tests/e2e/setup_docker.sh` installs
and starts one. Images are built once per session from the Dockerfiles as shipped (the
built_images fixture); every compose project gets its own name, port and volumes and is
taken down with `compose down -v`, also when a test fails.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .admin import FEDERATION_TIMEOUT_S, TOOLKIT_HINT, admin, exited, job_cli, wait_for
from .dockerutil import NO_GPU_FILE, ComposeProject, run

pytestmark = pytest.mark.e2e


def test_gpu_policy_on_a_machine_without_gpu(compose_project) -> None:
    """hetero, with the GPU services exactly as shipped minus their device reservation:
    the enforcing node exits non-zero naming the toolkit, the offering node trains on CPU
    and says why (log and `fedgpu nodes --json`)."""
    project: ComposeProject = compose_project(files=[NO_GPU_FILE])
    project.compose("up", "-d", "--no-build", profiles=["hetero"], timeout=300)

    enforced = wait_for(
        "node-gpu-enforced-1 to exit", lambda: exited(project, "node-gpu-enforced-1"), 120
    )
    assert enforced["ExitCode"] != 0, enforced
    enforced_log = project.logs("node-gpu-enforced-1")
    assert TOOLKIT_HINT in enforced_log, enforced_log
    assert "--gpu enforce" in enforced_log, enforced_log
    assert "Traceback" not in enforced_log, "a clear message, not a stack trace"

    def offered_registered() -> dict[str, Any] | None:
        doc = admin(project, "nodes")
        for node in (doc or {}).get("nodes", []):
            if node["name"] == "node-gpu-offered-1" and node.get("gpu_decision"):
                return node
        return None

    offered = wait_for("node-gpu-offered-1 to register", offered_registered, 120)
    decision = offered["gpu_decision"]
    assert decision["device"] == "cpu", decision
    assert decision.get("reason"), f"the CPU fallback gives its reason: {decision}"
    # The same reason is in the node's own log (one structured decision line).
    assert decision["reason"] in project.logs("node-gpu-offered-1")
    assert project.container("node-gpu-offered-1")["State"] == "running"


def test_fake_nvml_inside_the_node_image(built_images, tmp_path: Path) -> None:
    """The fake libnvidia-ml.so.1 mounted into a node container: `fedgpu devices --json`
    there reports the simulated GPUs, so the image's NVML path works end to end."""
    from tests.fixtures.fake_nvml import build_fake_nvml, fake_uuid, write_inventory

    try:
        libdir = build_fake_nvml(tmp_path / "fake-nvml")
    except RuntimeError as exc:  # no C compiler on the host
        pytest.skip(str(exc))
    inventory = write_inventory(
        libdir / "inventory.txt",
        gpus=[
            {"name": "NVIDIA Fake A100", "memory_total_mib": 40960, "memory_used_mib": 1024},
            {"name": "NVIDIA Fake T4", "memory_total_mib": 15360, "memory_used_mib": 0},
        ],
    )
    # pytest's tmp dirs are private to root; the container runs as UID 10001.
    for path in (tmp_path, libdir):
        path.chmod(0o755)
    for path in libdir.iterdir():
        path.chmod(0o644)

    proc = run(
        [
            "docker", "run", "--rm",
            "-v", f"{libdir}:/opt/fake-nvml:ro",
            "-e", "LD_LIBRARY_PATH=/opt/fake-nvml",
            "-e", f"FAKE_NVML_CONFIG=/opt/fake-nvml/{inventory.name}",
            built_images["node"], "devices", "--json",
        ],
        timeout=120,
    )  # fmt: skip
    doc = json.loads(proc.stdout)
    nvml = doc["nvml"]
    assert nvml["available"] is True, doc
    assert nvml["driver_version"] == "550.54.15"
    assert [(g["name"], g["uuid"]) for g in nvml["gpus"]] == [
        ("NVIDIA Fake A100", fake_uuid(0)),
        ("NVIDIA Fake T4", fake_uuid(1)),
    ]
    # The image defaults to --gpu offer: the policy picks the GPU with most free memory.
    assert doc["decision"]["mode"] == "offer"
    assert doc["decision"]["gpu_uuid"] == fake_uuid(0), doc["decision"]


def container_id(project: ComposeProject, service: str) -> str:
    """The service's container ID: a restarted container keeps it, a recreated one does not.
    `compose ps --format json` spells the key "ID" (compose v2); older releases wrote "Id"."""
    c = project.container(service)
    found = c.get("ID") or c.get("Id")
    assert found, f"compose ps gave no container ID for {service}: {c}"
    return str(found)


def test_two_jobs_on_the_same_nodes_across_an_aggregator_restart(
        compose_project, tmp_path: Path) -> None:
    """The federation stays up: the example job runs, a second job is submitted, the
    aggregator container restarts in between, and the same node containers run both."""
    project: ComposeProject = compose_project()
    project.compose("up", "-d", "--no-build", profiles=["cpu"], timeout=300)

    def jobs_ended(count: int):
        def probe() -> list[dict[str, Any]] | None:
            listed = job_cli(project, "list")
            failed = [j for j in listed if j["state"] in ("failed", "stopped")]
            if failed:
                raise AssertionError(f"a job did not finish: {failed}")
            done = [j for j in listed if j["state"] == "finished"]
            return listed if len(done) >= count else None
        return probe

    wait_for("the example job to finish", jobs_ended(1), FEDERATION_TIMEOUT_S)
    nodes_before = {n: container_id(project, n) for n in
                    ("node-cpu-1", "node-cpu-2", "node-cpu-3")}
    project.compose("restart", "aggregator", timeout=120)
    wait_for("the aggregator to be healthy again",
             lambda: project.container("aggregator").get("Health") == "healthy", 180)
    second = tmp_path / "second.toml"
    # A top-level key goes before the file's first [table]. One round is enough to show the
    # same nodes serve the second job (the example job's three already ran on them).
    example = (Path(__file__).resolve().parents[2] / "compose" / "job.toml").read_text()
    assert example.count("\nrounds = 3\n") == 1, example
    second.write_text('name = "second"\n' + example.replace("\nrounds = 3\n", "\nrounds = 1\n"))
    submitted = job_cli(project, "submit", str(second))
    assert submitted["state"] == "queued"
    listed = wait_for("the second job to finish", jobs_ended(2), FEDERATION_TIMEOUT_S)
    assert [j["name"] for j in listed][-1] == "second" and len(listed) == 2
    # The restart did not queue the example job again, and the nodes are the same containers.
    assert {n: container_id(project, n) for n in nodes_before} == nodes_before
    assert all(project.container(n)["State"] == "running" for n in nodes_before)
    status = job_cli(project, "status", submitted["job_id"])
    assert status["rounds_done"] == status["rounds"] == 1
