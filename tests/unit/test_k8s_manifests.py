"""deploy/k8s, rendered by the real `kubectl kustomize`: every overlay validates against the
Kubernetes 1.30 and 1.34 schemas, GPUs are limited exactly where compose reserves them, and
every command line, environment and probe in the pods is one the real `fedgpu` CLI accepts."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from fedgpu.core.constants import PROFILES
from fedgpu.node import policy
from tests.fixtures import k8s
from tests.fixtures.federation import ROOT

SCHEMAS = ("1.30", "1.34")
COMPOSE = ROOT / "compose" / "compose.yaml"
# Set for Kubernetes alone: the node's demo partition, read by subPathExpr, not by fedgpu.
K8S_ONLY_ENV = {"FEDGPU_DEMO_PARTITION"}


def test_there_is_one_overlay_per_compose_profile() -> None:
    assert {p.name for p in k8s.OVERLAYS.iterdir() if p.is_dir()} == set(PROFILES)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("version", SCHEMAS)
def test_overlay_validates_strictly_against_the_kubernetes_schema(profile: str,
                                                                   version: str) -> None:
    objects = k8s.overlay(profile)
    assert objects, f"{profile} rendered nothing"
    for obj in objects:
        # validate() raises on any unknown or mistyped field (strict) and on a kind it has no
        # schema for; it answers with the schema version it used, which must be the one asked.
        used = kubernetes_validate.validate(obj, version, strict=True)
        assert used == version, f"{obj['kind']}: validated against {used}, not {version}"


def test_the_strict_schema_refuses_what_kubernetes_would() -> None:
    """The validator above is not a rubber stamp: a misspelt field and a wrong type fail."""
    workload = k8s.workloads(k8s.overlay("cpu"))[0]
    workload["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(workload, "1.34", strict=True)
    del workload["spec"]["template"]["spec"]["containers"][0]["resource"]
    workload["spec"]["replicas"] = "1"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(workload, "1.34", strict=True)


# --- GPUs: the same meaning in compose and in Kubernetes --------------------------------------

def _interpolate(text: str) -> str:
    """Compose's ${VAR:-default} with the defaults (compose/.env is not read here)."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m[2] or "", text)


def compose_nodes(profile: str) -> dict[str, dict[str, Any]]:
    """Per node service of a compose profile: its --gpu policy, whether it reserves GPUs, and
    which demo partition it mounts."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    nodes = {}
    for name, svc in services.items():
        if profile not in svc.get("profiles", []) or name == "data-split":
            continue
        command = svc["command"]
        argv = shlex.split(_interpolate(command)) if isinstance(command, str) else command
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get(
            "devices", [])
        (data,) = [v.split(":")[0] for v in svc["volumes"] if v.split(":")[1] == "/data"]
        nodes[name] = {"gpu": argv[argv.index("--gpu") + 1],
                       "reserves_gpu": any(d.get("driver") == "nvidia" for d in devices),
                       "partition": re.fullmatch(r"node-(\d)-data", data)[1]}
    return nodes


def k8s_nodes(profile: str) -> dict[str, dict[str, Any]]:
    objects = k8s.overlay(profile)
    nodes = {}
    for c in k8s.containers(objects):
        if k8s.role(c.workload) == "node" and not c.init:
            nodes[k8s.site(c.workload)] = {
                "gpu": k8s.environment(c, objects)["FEDGPU_GPU"],
                "reserves_gpu": c.gpu_limit() is not None,
                "partition": c.pod["metadata"]["labels"]["fedgpu.io/demo-partition"]}
    return nodes


@pytest.mark.parametrize("profile", PROFILES)
def test_overlay_has_the_compose_profiles_nodes_with_the_same_gpu_meaning(profile: str) -> None:
    compose = compose_nodes(profile)
    assert compose, f"compose profile {profile} has no node services"
    # Same sites, same --gpu policy, a GPU reservation exactly where compose has one, and the
    # same demo partition (so hetero trains on three different parts, as in compose).
    assert k8s_nodes(profile) == compose
    # ... and compose reserves GPUs exactly on its GPU-policy services.
    for name, node in compose.items():
        assert node["reserves_gpu"] == (node["gpu"] in ("offer", "enforce")), name


@pytest.mark.parametrize("profile", PROFILES)
def test_gpu_limits_are_on_exactly_the_gpu_node_workloads(profile: str) -> None:
    objects = k8s.overlay(profile)
    for c in k8s.containers(objects):
        resources = c.spec.get("resources", {})
        assert k8s.GPU not in resources.get("requests", {}), f"{c.name}: GPUs go in limits only"
        pod = c.pod["spec"]
        gpu_site = k8s.gpu_policy(c.workload, objects) in ("offer", "enforce")
        if gpu_site and not c.init:
            assert int(c.gpu_limit()) >= 1, c.name
        else:
            # The aggregator, CPU sites and the demo-data init container: no GPU at all.
            assert c.gpu_limit() is None, f"{c.name} must not claim a GPU"
        selector = pod.get("nodeSelector", {})
        tolerations = [t for t in pod.get("tolerations", []) if t.get("key") == k8s.GPU]
        if gpu_site:
            assert selector.get("nvidia.com/gpu.present") == "true", c.name
            assert tolerations and tolerations[0]["operator"] == "Exists", c.name
        else:
            assert "nvidia.com/gpu.present" not in selector and not tolerations, c.name
            if k8s.role(c.workload) == "node" and not c.init:
                # The node image says NVIDIA_VISIBLE_DEVICES=all: where NVIDIA's runtime is
                # the default, a pod without this would see every GPU of its host.
                assert k8s.environment(c, objects)["NVIDIA_VISIBLE_DEVICES"] == "void", c.name


# --- the pods' command lines, parsed by the real CLI ------------------------------------------

def fedgpu_invocations(c: k8s.Container) -> list[tuple[str, list[str]]]:
    """Every fedgpu command line of a container: its args (the images' entrypoint is fedgpu)
    and its exec probes."""
    calls = [("args", list(c.spec["args"]))]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = c.spec.get(probe, {}).get("exec", {}).get("command")
        if command:
            assert command[0] == "fedgpu", f"{c.name} {probe}: {command}"
            calls.append((probe, command[1:]))
    return calls


@pytest.mark.parametrize("profile", PROFILES)
def test_the_cli_accepts_every_command_line_and_variable(profile: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    objects = k8s.overlay(profile)
    seen = set()
    for c in k8s.containers(objects):
        assert c.spec["image"].split("/")[-1].split(":")[0] in ("server", "node"), c.name
        env = k8s.environment(c, objects)
        for where, argv in fedgpu_invocations(c):
            command, params = k8s.parse_cli(argv, env, monkeypatch)
            seen.add(" ".join(argv[:2]))
            if where == "args":
                # A variable fedgpu does not read is a renamed or misspelt option.
                unread = {n for n in env if n.startswith("FEDGPU_")} - k8s.envvars(command)
                assert unread <= K8S_ONLY_ENV, f"{c.name}: fedgpu {argv[:2]} ignores {unread}"
            check_meaning(c, argv, params, env)
    assert {"server start", "node start", "data split", "node health"} <= seen


@pytest.mark.parametrize("profile", PROFILES)
def test_the_aggregator_is_probed_natively_on_its_health_port(profile: str) -> None:
    """Kubernetes' grpc: probes, on the port the aggregator opens for them (--health-port):
    the mutual-TLS gRPC port would refuse the kubelet, which shows no client certificate."""
    objects = k8s.overlay(profile)
    (sts,) = k8s.by_kind(objects, "StatefulSet")
    c = k8s.main_container(sts)
    env = k8s.environment(c, objects)
    ports = {p["name"]: p["containerPort"] for p in c.spec["ports"]}
    assert int(env["FEDGPU_HEALTH_PORT"]) == ports["health"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c.spec[probe]["grpc"] == {"port": ports["health"]}, probe


def check_meaning(c: k8s.Container, argv: list[str], params: dict[str, Any],
                  env: dict[str, str]) -> None:
    """Beyond parsing: the values say what the deployment means."""
    if argv[:2] == ["node", "start"]:
        site = k8s.site(c.workload)
        assert params["name"] == site == c.workload["metadata"]["name"], c.name
        assert params["aggregator"] == "aggregator:50051"
        assert str(params["data"]) == "/data"
        assert (str(params["tls_cert"]), str(params["tls_key"]), str(params["tls_ca"])) == (
            "/certs/node.crt", "/certs/node.key", "/certs/ca.crt")
        # The node's own validation of its GPU flags (what `node start` runs first).
        policy.parse_gpu_flags(params["gpu"], params["gpu_index"], params["gpu_min_free_mib"],
                               params["gpu_memory_fraction"])
        if "FEDGPU_RING_PORT" in env:
            assert params["ring_host"] == k8s.POD_IP and params["ring_port"] == 29500
    elif argv[:2] == ["server", "start"]:
        assert params["port"] == 50051 and params["metrics_port"] == 9464
        assert params["bulk_port"] == 50052
        assert params["health_port"] == 8081
        assert str(params["state_dir"]) == "/var/lib/fedgpu"
        assert str(params["job"]) == "/etc/fedgpu/job.toml"
        assert str(params["tls_ca"]) == "/certs/ca.crt"
    elif argv[0] == "health":
        assert params["address"] == f"127.0.0.1:{env['FEDGPU_PORT']}"
        assert str(params["tls_cert"]) == "/certs/server.crt"


def test_a_renamed_flag_would_fail_the_cli_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parse above is real: what the CLI does not know is refused."""
    with pytest.raises(Exception, match="No such option"):
        k8s.parse_cli(["node", "start", "--gpu-policy", "offer"], {}, monkeypatch)
    with pytest.raises(Exception, match="integer"):
        k8s.parse_cli(["server", "start", "--job", "j.toml"], {"FEDGPU_PORT": "grpc"}, monkeypatch)
    command, _ = k8s.parse_cli(["node", "start"], {"FEDGPU_DATA": "/d", "FEDGPU_AGGREGATOR": "a:1"},
                           monkeypatch)
    assert "FEDGPU_GPU_INDEX" in k8s.envvars(command) and "FEDGPU_GPUS" not in k8s.envvars(command)


# --- wiring: names, ports, secrets, files ------------------------------------------------------

def _aggregator_objects(objects: list[dict[str, Any]]) -> tuple[dict, dict, dict]:
    (sts,) = k8s.by_kind(objects, "StatefulSet")
    (svc,) = [s for s in k8s.by_kind(objects, "Service") if s["metadata"]["name"] == "aggregator"]
    (netpol,) = [p for p in k8s.by_kind(objects, "NetworkPolicy")
                 if p["metadata"]["name"] == "aggregator"]
    return sts, svc, netpol


@pytest.mark.parametrize("profile", PROFILES)
def test_every_aggregator_port_is_declared_served_and_admitted(profile: str) -> None:
    """The port list is kept in one file; this keeps its entries together: each port the
    aggregator is told to open is a container port, a Service port and an admitted port."""
    objects = k8s.overlay(profile)
    sts, svc, netpol = _aggregator_objects(objects)
    c = k8s.main_container(sts)
    env = k8s.environment(c, objects)
    declared = {p["containerPort"]: p["name"] for p in c.spec["ports"]}
    opened = {int(v) for k, v in env.items() if re.fullmatch(r"FEDGPU_\w*PORT", k) and v != "0"}
    assert opened == set(declared), f"env opens {opened}, container declares {declared}"
    served = {p["targetPort"]: p["port"] for p in svc["spec"]["ports"]}
    admitted = {p["port"] for rule in netpol["spec"]["ingress"] for p in rule["ports"]}
    for number, name in declared.items():
        assert served.get(name) == number, f"Service does not serve {name}:{number}"
        assert name in admitted, f"the aggregator's NetworkPolicy admits nobody on {name}"
    assert netpol["spec"]["egress"] == [] and "Egress" in netpol["spec"]["policyTypes"]
    # Nodes dial the Service by name on its gRPC port.
    nodes = k8s.node_workloads(objects)
    for c in k8s.containers(nodes):
        if not c.init:
            assert k8s.environment(c, objects)["FEDGPU_AGGREGATOR"] == (
                f"{svc['metadata']['name']}:{served['grpc']}")


@pytest.mark.parametrize("profile", PROFILES)
def test_each_pod_mounts_only_its_own_key_and_sites_do_not_overlap(profile: str) -> None:
    objects = k8s.overlay(profile)
    selectors = []
    for w in k8s.workloads(objects):
        pod = w["spec"]["template"]["spec"]
        secrets = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
        own = "tls-aggregator" if k8s.role(w) == "aggregator" else f"tls-{k8s.site(w)}"
        assert secrets == [own], f"{w['metadata']['name']} mounts {secrets}"
        selectors.append(tuple(sorted(w["spec"]["selector"]["matchLabels"].items())))
        if k8s.role(w) == "node":
            claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
                      if "persistentVolumeClaim" in v}
            assert claims == {f"data-{k8s.site(w)}"}
            assert claims <= {o["metadata"]["name"] for o in k8s.by_kind(objects,
                                                                          "PersistentVolumeClaim")}
    # Two workloads selecting the same pods would fight over them.
    assert len(set(selectors)) == len(selectors)
    # Secrets are never rendered: they come from `fedgpu certs k8s-secrets`.
    assert not k8s.by_kind(objects, "Secret")


@pytest.mark.parametrize("profile", PROFILES)
def test_pods_run_as_the_images_non_root_user_without_privileges(profile: str) -> None:
    for c in k8s.containers(k8s.overlay(profile)):
        pod = c.pod["spec"]
        assert pod["securityContext"]["runAsUser"] == 10001, c.name
        assert pod["automountServiceAccountToken"] is False, c.name
        ctx = c.spec["securityContext"]
        assert ctx["runAsNonRoot"] and ctx["readOnlyRootFilesystem"], c.name
        assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"]["drop"] == ["ALL"]
        assert {"cpu", "memory"} <= set(c.spec["resources"]["limits"]), c.name


def test_ring_overlay_opens_the_ring_port_between_peers_only() -> None:
    objects = k8s.overlay("ring")
    (svc,) = [s for s in k8s.by_kind(objects, "Service") if s["metadata"]["name"] == "ring"]
    assert svc["spec"]["clusterIP"] == "None"
    (ring,) = [p for p in k8s.by_kind(objects, "NetworkPolicy") if p["metadata"]["name"] == "ring"]
    peers = ring["spec"]["podSelector"]
    for rule, side in ((ring["spec"]["ingress"][0], "from"), (ring["spec"]["egress"][0], "to")):
        assert rule[side] == [{"podSelector": peers}]
        assert {p["port"] for p in rule["ports"]} & {"ring", 29500}
    for c in k8s.containers(k8s.node_workloads(objects)):
        if not c.init:
            assert {"name": "ring", "containerPort": 29500, "protocol": "TCP"} in c.spec["ports"]
    # The other overlays keep nodes closed to each other.
    assert not [p for p in k8s.by_kind(k8s.overlay("cpu"), "NetworkPolicy")
                if p["metadata"]["name"] == "ring"]


@pytest.mark.parametrize(("copy", "original"), [
    ("base/job.toml", "job.toml"), ("components/ring/job-ring.toml", "job-ring.toml")])
def test_job_files_are_the_compose_ones(copy: str, original: str) -> None:
    # Kustomize loads no file from outside a kustomization's folder: these are copies.
    assert (k8s.K8S / copy).read_text() == (ROOT / "compose" / original).read_text(), (
        f"deploy/k8s/{copy} differs from compose/{original}: copy it again")


@pytest.mark.parametrize("profile", PROFILES)
def test_the_job_config_map_is_the_profiles_job(profile: str) -> None:
    objects = k8s.overlay(profile)
    (cm,) = [o for o in k8s.by_kind(objects, "ConfigMap") if "job.toml" in o.get("data", {})]
    want = "job-ring.toml" if profile == "ring" else "job.toml"
    assert cm["data"]["job.toml"] == (ROOT / "compose" / want).read_text()


def test_every_object_is_labelled_and_namespaced() -> None:
    for profile in PROFILES:
        for obj in k8s.overlay(profile):
            assert obj["metadata"]["namespace"] == "fedgpu", obj["metadata"]["name"]
            assert obj["metadata"]["labels"]["app.kubernetes.io/name"] == "fedgpu"


def test_a_site_is_a_short_kustomization() -> None:
    """Sites stay small patches of one node base (STYLE.md "Kubernetes")."""
    sites = sorted((k8s.K8S / "sites").iterdir())
    assert sites
    for path in sites:
        text = (path / "kustomization.yaml").read_text()
        assert len(text.splitlines()) <= 12, path
        assert f"fedgpu.io/site: {path.name}" in text and "../../node" in text, path


def _paths() -> list[Path]:
    return sorted(k8s.K8S.rglob("*.yaml"))


def test_every_kustomization_is_used_by_an_overlay() -> None:
    """Nothing in deploy/k8s is dead: every folder is used by an overlay or is one."""
    used: set[Path] = set()
    for path in _paths():
        if path.name == "kustomization.yaml":
            doc = yaml.safe_load(path.read_text())
            for ref in doc.get("resources", []) + doc.get("components", []):
                used.add((path.parent / ref).resolve())
    for path in _paths():
        if path.name == "kustomization.yaml" and path.parent.parent != k8s.OVERLAYS:
            assert path.parent.resolve() in used or path.parent.name in (
                "public-aggregator", "dashboard", "site-policy", "multi-gpu"), (
                f"{path.parent} is used by no overlay")
