"""compose/compose.yaml as Compose resolves it: profiles, GPU reservations, wiring.

`docker compose config` needs the compose plugin but no engine, so these run wherever
the plugin is installed and skip (with the reason) elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

import pytest

from .dockerutil import (
    COMPOSE_FILE,
    GPU_IDS_FILE,
    NO_GPU_FILE,
    PROFILES,
    REPO,
    compose_available,
    compose_config,
    run,
)

_reason = compose_available()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")

# What each profile must start besides the aggregator and the one-shot data-split.
EXPECTED_NODES = {
    "cpu": {"node-cpu-1", "node-cpu-2", "node-cpu-3"},
    "gpu-offered": {"node-gpu-offered-1", "node-gpu-offered-2", "node-gpu-offered-3"},
    "gpu-enforced": {"node-gpu-enforced-1", "node-gpu-enforced-2", "node-gpu-enforced-3"},
    "hetero": {"node-cpu-1", "node-gpu-offered-1", "node-gpu-enforced-1"},
    "ring": {"node-ring-1", "node-ring-2", "node-ring-3"},
}
GPU_MODE = {"node-cpu": "none", "node-gpu-offered": "offer", "node-gpu-enforced": "enforce",
            "node-ring": "none"}
CPU_KINDS = {"node-cpu", "node-ring"}


def kind(service: str) -> str:
    return service.rsplit("-", 1)[0]


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    deploy = service.get("deploy") or {}
    reservations = (deploy.get("resources") or {}).get("reservations") or {}
    return list(reservations.get("devices") or [])


def node_services(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in config["services"].items() if n.startswith("node-")}


def data_volume(service: dict[str, Any]) -> str:
    (mount,) = [v for v in service["volumes"] if v["target"] == "/data"]
    assert mount.get("read_only") is True, "a node's data is mounted read-only"
    return str(mount["source"])


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_starts_the_right_services(profile: str) -> None:
    config = compose_config(profile)
    assert set(config["services"]) == {"aggregator", "certs", "data-split"} | EXPECTED_NODES[
        profile]


@pytest.mark.parametrize("profile", PROFILES)
def test_gpu_reservations_exactly_on_gpu_services(profile: str) -> None:
    for name, service in node_services(compose_config(profile)).items():
        devices = gpu_devices(service)
        if kind(name) in CPU_KINDS:
            assert devices == [], f"{name} must reserve no GPU"
            continue
        assert len(devices) == 1, f"{name}: one device request"
        (device,) = devices
        assert device["driver"] == "nvidia"
        assert device["capabilities"] == ["gpu"]
        assert ("count" in device) != ("device_ids" in device), (
            f"{name}: exactly one of count / device_ids, got {device}"
        )
    # Neither the aggregator nor the data split ever reserves a GPU.
    config = compose_config(profile)
    assert gpu_devices(config["services"]["aggregator"]) == []
    assert gpu_devices(config["services"]["data-split"]) == []


@pytest.mark.parametrize("profile", PROFILES)
def test_nodes_wiring(profile: str) -> None:
    config = compose_config(profile)
    nodes = node_services(config)
    token = config["services"]["aggregator"]["environment"]["FEDGPU_TOKEN"]
    volumes = set()
    for name, service in nodes.items():
        command = service["command"]
        assert command[:2] == ["node", "start"]
        assert command[command.index("--gpu") + 1] == GPU_MODE[kind(name)], name
        depends = service["depends_on"]
        assert depends["aggregator"]["condition"] == "service_healthy"
        assert depends["data-split"]["condition"] == "service_completed_successfully"
        env = service["environment"]
        assert env["FEDGPU_AGGREGATOR"] == "aggregator:50051"
        assert env["FEDGPU_NODE_NAME"] == name
        assert env["FEDGPU_TOKEN"] == token
        volumes.add(data_volume(service))
    assert len(volumes) == len(nodes), "each node of a profile mounts its own partition"
    split = config["services"]["data-split"]
    assert {v["source"] for v in split["volumes"]} >= volumes


@pytest.mark.parametrize("profile", PROFILES)
def test_mutual_tls_by_default(profile: str) -> None:
    """Every service speaks mTLS with material mounted read-only, one key pair per node."""
    config = compose_config(profile)
    services = config["services"]

    def cert_mounts(service: dict[str, Any]) -> list[dict[str, Any]]:
        return [v for v in service.get("volumes", []) if v["target"] == "/certs"]

    (agg,) = cert_mounts(services["aggregator"])
    assert agg["read_only"] is True and agg["source"].endswith("/certs/server")
    env = services["aggregator"]["environment"]
    assert (env["FEDGPU_TLS_CERT"], env["FEDGPU_TLS_KEY"], env["FEDGPU_TLS_CA"]) == (
        "/certs/server.crt", "/certs/server.key", "/certs/ca.crt")
    sources = set()
    for name, service in node_services(config).items():
        (mount,) = cert_mounts(service)
        assert mount["read_only"] is True
        assert mount["source"].endswith(f"/certs/nodes/{name}"), "a node gets only its own key"
        sources.add(mount["source"])
        assert service["environment"]["FEDGPU_TLS_CERT"] == "/certs/node.crt"
        assert service["depends_on"]["certs"]["condition"] == "service_completed_successfully"
        assert name in services["certs"]["command"][0], f"certs makes {name}'s key pair"
    assert len(sources) == len(node_services(config))
    # Only the one-shot that makes the material sees the CA's key.
    assert [n for n, s in services.items() if any(
        v["target"] == "/certs" and not v.get("read_only") for v in s.get("volumes", []))
    ] == ["certs"]


def test_ring_peers_can_reach_each_other() -> None:
    """Ring nodes connect to each other: same network, own hostname, ring port exposed."""
    config = compose_config("ring")
    nodes = node_services(config)
    networks = {frozenset(s.get("networks", {"default": None})) for s in nodes.values()}
    assert len(networks) == 1, "every ring node is on the same compose network"
    ports = set()
    for name, service in nodes.items():
        env = service["environment"]
        assert env["FEDGPU_RING_HOST"] == name == service["hostname"]
        ports.add(env["FEDGPU_RING_PORT"])
        assert env["FEDGPU_RING_PORT"] in [str(p) for p in service["expose"]]
        assert "ports" not in service, "peers talk on the compose network, not via the host"
    assert ports == {"29500"}
    from fedgpu.core.job import load_job

    job = load_job(REPO / "compose" / "job-ring.toml")
    assert job.mode == "ring" and job.min_nodes == len(nodes)


def test_the_hetero_example_job_fits_the_hetero_profile() -> None:
    """compose/job-hetero.toml: equal training time per site under FedNova, and a min_nodes
    the profile still reaches when its --gpu enforce node refuses to start (no GPU)."""
    from fedgpu.core.job import load_job

    nodes = node_services(compose_config("hetero"))
    job = load_job(REPO / "compose" / "job-hetero.toml")
    assert job.hetero.local_work == "time" and job.strategy == "fednova"
    assert job.hetero.round_train_s is not None
    assert 0 < job.hetero.round_train_s < job.round_deadline_s
    without_enforce = [n for n in nodes if GPU_MODE[kind(n)] != "enforce"]
    assert job.min_nodes == len(without_enforce) == 2


def test_gpu_count_comes_from_the_environment() -> None:
    config = compose_config("gpu-enforced", env={"FEDGPU_GPU_COUNT": "2"})
    for service in node_services(config).values():
        (device,) = gpu_devices(service)
        assert int(device["count"]) == 2
        assert "device_ids" not in device


def test_device_ids_override_replaces_count() -> None:
    env = {"FEDGPU_GPU_DEVICE_IDS": "GPU-0f00d"}
    for profile in ("gpu-offered", "gpu-enforced", "hetero"):
        config = compose_config(profile, files=[GPU_IDS_FILE], env=env)
        for name, service in node_services(config).items():
            devices = gpu_devices(service)
            if kind(name) == "node-cpu":
                assert devices == []
                continue
            (device,) = devices
            assert device["device_ids"] == ["GPU-0f00d"]
            assert "count" not in device, f"{name}: never both count and device_ids"


def test_no_gpu_override_drops_only_reservations() -> None:
    config = compose_config("hetero", files=[NO_GPU_FILE])
    shipped = compose_config("hetero")
    for name, service in node_services(config).items():
        assert gpu_devices(service) == []
        assert service["command"] == shipped["services"][name]["command"]


def test_aggregator_service() -> None:
    aggregator = compose_config()["services"]["aggregator"]
    assert "profiles" not in aggregator, "the aggregator starts with every profile"
    assert aggregator["healthcheck"]["test"][:3] == ["CMD", "fedgpu", "health"]
    ports = {p["target"]: p for p in aggregator["ports"]}
    assert set(ports) == {50051, 50052, 8080}
    # The bulk data port is published beside gRPC, and the aggregator is told to open it.
    assert ports[50052]["host_ip"] == ports[50051]["host_ip"]
    command = aggregator["command"]
    assert command[command.index("--bulk-port") + 1] == "50052"
    # The dashboard is plain HTTP: published on the host's loopback only.
    assert ports[8080]["host_ip"] == "127.0.0.1"
    assert aggregator["environment"]["FEDGPU_UI_PORT"] == "8080"
    targets = {v["target"]: v for v in aggregator["volumes"]}
    assert targets["/var/lib/fedgpu"]["type"] == "volume"
    assert targets["/etc/fedgpu/job.toml"]["read_only"] is True


def test_unknown_profile_starts_no_nodes() -> None:
    config = compose_config("no-such-profile")
    assert set(config["services"]) == {"aggregator", "certs"}


def test_token_is_required() -> None:
    """Without compose/.env and FEDGPU_TOKEN, compose refuses instead of running open."""
    env = {k: v for k, v in os.environ.items() if k != "FEDGPU_TOKEN"}
    proc = subprocess.run(
        [
            "docker",
            "compose",
            "-f",
            str(COMPOSE_FILE),
            "--env-file",
            os.devnull,
            "--profile",
            "cpu",
            "config",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "FEDGPU_TOKEN" in proc.stderr


def test_make_up_refuses_unknown_profile() -> None:
    script = REPO / "compose" / "compose.sh"
    proc = run(["bash", str(script), "up", "no-such-profile"], check=False)
    assert proc.returncode == 2
    assert "unknown profile 'no-such-profile'" in proc.stderr
    assert "cpu gpu-offered gpu-enforced hetero" in proc.stderr
    makefile = REPO / "Makefile"
    if shutil.which("make") and makefile.exists() and "\nup:" in makefile.read_text():
        proc = run(["make", "-s", "-C", str(REPO), "up", "PROFILE=no-such-profile"], check=False)
        assert proc.returncode != 0
        assert "unknown profile" in proc.stderr


def test_env_file_matches_compose() -> None:
    """Every variable compose/.env sets is one compose.yaml (or an override) reads."""
    text = "\n".join(p.read_text() for p in (COMPOSE_FILE, GPU_IDS_FILE))
    for line in (REPO / "compose" / ".env").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name = line.split("=", 1)[0]
        assert "${" + name in text, f"compose/.env sets {name}, which no compose file reads"
