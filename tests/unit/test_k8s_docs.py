"""The Kubernetes how-to's examples (docs/how-to/kubernetes.md) render and mean what the page
says: an operator's own site, and swapping the GPU limit for a MIG slice."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.fixtures import k8s
from tests.fixtures.federation import ROOT

SECTION = (ROOT / "docs" / "how-to" / "kubernetes.md").read_text()


def yaml_block(containing: str) -> dict[str, Any]:
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", SECTION, re.S) if containing in b]
    return yaml.safe_load(block)


def rebase(doc: dict[str, Any], here: Path, folder: Path) -> dict[str, Any]:
    """The example's ../../ paths, as seen from `here` instead of deploy/k8s/<folder>/NAME."""
    rel = os.path.relpath(folder, here)
    for key in ("resources", "components"):
        doc[key] = [p.replace("../../", f"{rel}/", 1) for p in doc.get(key, [])]
    return doc


def test_a_site_of_your_own_gets_its_names_from_its_suffix(tmp_path: Path) -> None:
    doc = rebase(yaml_block("node-site-a"), tmp_path, k8s.K8S)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(doc))
    objects = k8s.render(tmp_path)
    (deployment,) = k8s.by_kind(objects, "Deployment")
    assert deployment["metadata"]["name"] == k8s.site(deployment) == "node-site-a"
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "tls-node-site-a"
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == "data-node-site-a"
    assert [o["metadata"]["name"] for o in k8s.by_kind(objects, "PersistentVolumeClaim")] == [
        "data-node-site-a"]
    assert k8s.main_container(deployment).gpu_limit() == 1  # kinds/gpu-enforced


def test_the_mig_patch_swaps_the_limit_on_the_gpu_sites_only(tmp_path: Path) -> None:
    patch = yaml_block("mig-1g.10gb")
    rel = os.path.relpath(k8s.OVERLAYS / "hetero", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"resources": [rel], **patch}))
    objects = k8s.render(tmp_path)
    for obj in objects:
        assert kubernetes_validate.validate(obj, "1.34", strict=True) == "1.34"
    limits = {k8s.site(w): k8s.main_container(w).spec["resources"]["limits"]
              for w in k8s.node_workloads(objects)}
    assert {s for s, lim in limits.items() if lim.get("nvidia.com/mig-1g.10gb") == 1} == {
        "node-gpu-offered-1", "node-gpu-enforced-1"}
    assert not [s for s, lim in limits.items() if k8s.GPU in lim]


def test_a_sites_policy_is_its_own_configmap_read_by_its_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The how-to's site with components/site-policy: the node mounts the site's own map
    (renamed with the site, hashed by the file) read-only, and `node start` reads the file
    from where the map is mounted, parsed by the node's own parser."""
    from fedgpu.core import site_policy

    doc = rebase(yaml_block("site-policy"), tmp_path, k8s.K8S)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(doc))
    text = 'studies = ["onco"]\nmax_rounds = 50\n'
    (tmp_path / "policy.toml").write_text(text)
    objects = k8s.render(tmp_path)
    for obj in objects:
        assert kubernetes_validate.validate(obj, "1.34", strict=True) == "1.34"
    (deployment,) = k8s.by_kind(objects, "Deployment")
    (config_map,) = [o for o in k8s.by_kind(objects, "ConfigMap")
                     if o["metadata"]["name"].startswith("site-policy-site-b-")]
    assert config_map["data"] == {"policy.toml": text}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["site-policy"]["configMap"]["name"] == config_map["metadata"]["name"]
    node = k8s.main_container(deployment)
    (mount,) = [m for m in node.spec["volumeMounts"] if m["name"] == "site-policy"]
    assert mount["readOnly"] is True
    # The site renders without the federation's base, whose map fedgpu-node it reads too.
    base = {"kind": "ConfigMap", "metadata": {"name": "fedgpu-node"}, "data": {}}
    env = k8s.environment(node, [*objects, base])
    # Where the kubelet puts the map's key, fedgpu node start finds its --policy.
    assert env["FEDGPU_NODE_POLICY"] == f"{mount['mountPath']}/policy.toml"
    _, params = k8s.parse_cli(["node", "start"], env, monkeypatch)
    assert params["policy_file"] == Path(env["FEDGPU_NODE_POLICY"])
    assert site_policy.parse(config_map["data"]["policy.toml"]).max_rounds == 50
