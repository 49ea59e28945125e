"""deploy/k8s's security: checkov passes on every overlay with each exception written down, the
Secrets `fedgpu certs k8s-secrets` writes are exactly what the pods mount (one pod's key each,
never the CA key), the component that opens the aggregator to outside sites opens only its gRPC
port, and the dashboard component keeps its plain HTTP on the pod's loopback."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from fedgpu.core import certs
from fedgpu.core.constants import PROFILES
from tests.fixtures import k8s
from tests.fixtures.federation import ROOT, cli

EXCEPTIONS = k8s.K8S / "checkov-exceptions.yaml"
# `make test` installs checkov in a venv of its own (its pins would downgrade the dev venv's
# networkx and packaging); FEDGPU_CHECKOV names another binary.
CHECKOV = Path(os.environ.get("FEDGPU_CHECKOV", ROOT / ".venv-checkov" / "bin" / "checkov"))


def with_component(tmp_path: Path, profile: str, component: str) -> list[dict[str, Any]]:
    """An operator's own kustomization: an overlay plus one of deploy/k8s/components
    (Kustomize takes only relative paths to other folders)."""
    here = tmp_path / f"{component}-{profile}"
    here.mkdir()
    rel = os.path.relpath(k8s.K8S, here)
    (here / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [f"{rel}/overlays/{profile}"],
        "components": [f"{rel}/components/{component}"]}))
    return k8s.render(here)


def with_public_aggregator(tmp_path: Path, profile: str) -> list[dict[str, Any]]:
    return with_component(tmp_path, profile, "public-aggregator")


def test_dashboard_component_serves_on_loopback_and_requires_the_operator_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    objects = with_component(tmp_path, "cpu", "dashboard")
    for obj in objects:
        assert kubernetes_validate.validate(obj, "1.34", strict=True) == "1.34"
    (sts,) = k8s.by_kind(objects, "StatefulSet")
    c = k8s.main_container(sts)
    env = k8s.environment(c, objects, {"fedgpu-operator-token": {"token": "t0ken"}})
    _, params = k8s.parse_cli(c.spec["args"], env, monkeypatch)
    # The aggregator refuses --ui-port without the operator token: the Secret may no longer be
    # optional.
    assert (params["ui_port"], params["ui_host"], params["operator_token"]) == (
        8080, "127.0.0.1", "t0ken")
    with pytest.raises(AssertionError, match="Secret fedgpu-operator-token is missing"):
        k8s.environment(c, objects, {})
    # Plain HTTP on loopback: reached by port-forward, never through the Service or the policy.
    plain = k8s.overlay("cpu")
    for kind in ("Service", "NetworkPolicy"):
        assert k8s.by_kind(objects, kind) == k8s.by_kind(plain, kind)


def test_public_aggregator_opens_only_the_grpc_port_to_outside(tmp_path: Path) -> None:
    objects = with_public_aggregator(tmp_path, "hetero")
    for obj in objects:
        for version in ("1.30", "1.34"):
            assert kubernetes_validate.validate(obj, version, strict=True) == version
    (svc,) = [o for o in objects if o["metadata"]["name"] == "aggregator-public"
              and o["kind"] == "Service"]
    assert svc["spec"]["type"] == "LoadBalancer"
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["grpc"]
    (aggregator,) = k8s.by_kind(objects, "StatefulSet")
    pod_labels = aggregator["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (netpol,) = [o for o in objects if o["metadata"]["name"] == "aggregator-public"
                 and o["kind"] == "NetworkPolicy"]
    assert netpol["spec"]["podSelector"]["matchLabels"] == svc["spec"]["selector"]
    (rule,) = netpol["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == ["grpc"]
    assert svc["metadata"]["namespace"] == netpol["metadata"]["namespace"] == "fedgpu"


# --- checkov ---------------------------------------------------------------------------------

def written_exceptions() -> dict[str, str]:
    doc = yaml.safe_load(EXCEPTIONS.read_text())
    for check, reason in doc.items():
        assert isinstance(reason, str) and len(reason.split()) >= 8, (
            f"{check}: every exception needs its reason written down")
    return doc


def run_checkov(folder: Path) -> tuple[set[str], list[str]]:
    """Checkov's failed check ids on the manifests in folder, and one line per failure."""
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"}
    out = subprocess.run(
        [str(CHECKOV), "--directory", str(folder), "--framework", "kubernetes",
         "--output", "json", "--skip-download", "--compact"],
        capture_output=True, text=True, timeout=600, env=env)
    assert out.stdout.strip(), f"checkov printed nothing (exit {out.returncode}): {out.stderr}"
    reports = json.loads(out.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed, lines = set(), []
    for report in reports:
        assert report["summary"]["parsing_errors"] == 0, report["summary"]
        assert report["summary"]["resource_count"] > 0
        for f in report["results"]["failed_checks"]:
            failed.add(f["check_id"])
            lines.append(f"{f['check_id']} {f['check_name']}: {f['resource']} ({f['file_path']})")
    return failed, lines


def test_checkov_passes_every_overlay_except_the_written_exceptions(tmp_path: Path) -> None:
    if not CHECKOV.exists():
        pytest.skip(f"no checkov at {CHECKOV}: `make test` installs it (make checkov-venv)")
    exceptions = written_exceptions()
    rendered = tmp_path / "rendered"
    rendered.mkdir()
    for profile in PROFILES:
        (rendered / f"{profile}.yaml").write_text(
            yaml.safe_dump_all(k8s.overlay(profile), sort_keys=False))
    for component in ("public-aggregator", "dashboard"):
        (rendered / f"{component}.yaml").write_text(
            yaml.safe_dump_all(with_component(tmp_path, "cpu", component), sort_keys=False))
    failed, lines = run_checkov(rendered)
    unexplained = [line for line in lines if line.split()[0] not in exceptions]
    assert not unexplained, "checkov failures without a written exception:\n" + "\n".join(
        unexplained)
    stale = set(exceptions) - failed
    assert not stale, f"exceptions for checks that pass now, remove them: {sorted(stale)}"


def test_checkov_finds_what_it_should(tmp_path: Path) -> None:
    """The linter is awake: a privileged root container is reported."""
    if not CHECKOV.exists():
        pytest.skip(f"no checkov at {CHECKOV}: `make test` installs it (make checkov-venv)")
    (aggregator,) = k8s.by_kind(k8s.overlay("cpu"), "StatefulSet")
    container = aggregator["spec"]["template"]["spec"]["containers"][0]
    container["securityContext"] = {"privileged": True, "runAsUser": 0}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(aggregator))
    failed, _ = run_checkov(tmp_path)
    assert {"CKV_K8S_16", "CKV_K8S_40"} <= failed  # privileged; low UID


# --- Secrets from `fedgpu certs` --------------------------------------------------------------

def all_site_names() -> list[str]:
    return sorted({k8s.site(w) for p in PROFILES for w in k8s.node_workloads(k8s.overlay(p))})


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A CA, the aggregator's and every site's certificate, and the Secrets the real CLI
    writes from them."""
    k8s.need_kubectl()
    ca_dir = tmp_path_factory.mktemp("certs")
    certs.init_ca(ca_dir)
    certs.issue_server(ca_dir, sans=["aggregator", "aggregator.fedgpu.svc", "127.0.0.1"])
    for name in all_site_names():
        certs.issue_node(ca_dir, name)
    # An operator's certificate stays with the operator: no pod mounts it.
    certs.issue_operator(ca_dir)
    out = ca_dir.parent / "secrets"
    r = cli("certs", "k8s-secrets", "--dir", str(ca_dir), "--out", str(out), token="t0ken",
            operator_token="0perator")
    assert r.returncode == 0, r.stderr
    return ca_dir, out


def load_secrets(out: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


def test_secrets_are_valid_and_hold_one_pods_material_each(secrets_dir: tuple[Path, Path]
                                                           ) -> None:
    ca_dir, out = secrets_dir
    secrets = load_secrets(out)
    assert set(secrets) == {"tls-aggregator", "fedgpu-token", "fedgpu-operator-token",
                            *(f"tls-{n}" for n in all_site_names())}
    for name, secret in secrets.items():
        assert (out / f"{name}.json").stat().st_mode & 0o777 == 0o600, name
        for version in ("1.30", "1.34"):
            assert kubernetes_validate.validate(secret, version, strict=True) == version
        assert secret["metadata"]["namespace"] == "fedgpu"
        assert "ca.key" not in secret["data"], f"{name} carries the CA key"
    ca_key = (ca_dir / "ca.key").read_bytes()
    assert all(base64.b64decode(v) != ca_key for s in secrets.values() for v in s["data"].values())
    assert base64.b64decode(secrets["fedgpu-token"]["data"]["token"]) == b"t0ken"
    assert base64.b64decode(secrets["fedgpu-operator-token"]["data"]["token"]) == b"0perator"


@pytest.mark.parametrize("profile", PROFILES)
def test_every_pod_finds_its_own_secret_with_the_files_it_reads(
        profile: str, secrets_dir: tuple[Path, Path]) -> None:
    secrets = load_secrets(secrets_dir[1])
    objects = k8s.overlay(profile)
    for w in k8s.workloads(objects):
        c = k8s.main_container(w)
        env = k8s.environment(c, objects)
        (volume,) = [v for v in w["spec"]["template"]["spec"]["volumes"] if "secret" in v]
        secret = secrets[volume["secret"]["secretName"]]
        (mount,) = [m for m in c.spec["volumeMounts"] if m["name"] == volume["name"]]
        wanted = {env[k] for k in ("FEDGPU_TLS_CERT", "FEDGPU_TLS_KEY", "FEDGPU_TLS_CA")}
        assert wanted == {f"{mount['mountPath']}/{key}" for key in secret["data"]}, w["kind"]
        cert = base64.b64decode(secret["data"][Path(env["FEDGPU_TLS_CERT"]).name])
        if k8s.role(w) == "node":
            # The aggregator admits a node only under its certificate's name.
            assert certs.identity(cert) == env["FEDGPU_NODE_NAME"] == k8s.site(w)
        else:
            assert certs.identity(cert) == "aggregator"
        for var in c.spec["env"]:
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in secrets[ref["name"]]["data"], ref


def test_secrets_print_as_one_list_for_kubectl_apply(secrets_dir: tuple[Path, Path]) -> None:
    ca_dir, _ = secrets_dir
    r = cli("certs", "k8s-secrets", "--dir", str(ca_dir), "--node", "node-cpu-1",
            "--no-aggregator", "--namespace", "site-a", token=None, operator_token=None)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["kind"] == "List"
    assert [(s["metadata"]["name"], s["metadata"]["namespace"]) for s in doc["items"]] == [
        ("tls-node-cpu-1", "site-a")]
    assert set(doc["items"][0]["data"]) == {"node.crt", "node.key", "ca.crt"}


@pytest.mark.parametrize(("args", "message"), [
    (["--node", "node-9"], "no certificate for node-9"),
    (["--namespace", "Fed_GPU"], "not a valid Kubernetes name"),
])
def test_bad_requests_are_refused_in_one_line(secrets_dir: tuple[Path, Path], args: list[str],
                                              message: str) -> None:
    r = cli("certs", "k8s-secrets", "--dir", str(secrets_dir[0]), *args, token=None,
            operator_token=None)
    assert r.returncode == 2 and message in r.stderr and not r.stdout, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_existing_files_are_kept_without_force(secrets_dir: tuple[Path, Path]) -> None:
    ca_dir, out = secrets_dir
    before = {p: p.read_bytes() for p in out.iterdir()}
    r = cli("certs", "k8s-secrets", "--dir", str(ca_dir), "--out", str(out), token=None,
            operator_token=None)
    assert r.returncode == 2 and "pass --force" in r.stderr
    assert {p: p.read_bytes() for p in out.iterdir()} == before


def test_a_node_name_kubernetes_cannot_carry_is_refused(tmp_path: Path) -> None:
    certs.init_ca(tmp_path)
    certs.issue_node(tmp_path, "Site_A")
    r = cli("certs", "k8s-secrets", "--dir", str(tmp_path), "--no-aggregator", token=None,
            operator_token=None)
    assert r.returncode == 2 and "'Site_A' cannot be a Kubernetes site" in r.stderr
