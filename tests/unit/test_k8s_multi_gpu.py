"""Sites with several GPUs ([resources] workers): the `multi-gpu` Kustomize component gives each
GPU site's pod several whole GPUs and nothing to the CPU sites, rendered by the real `kubectl
kustomize` and valid for Kubernetes; compose's GPU services reserve FEDGPU_GPU_COUNT GPUs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.fixtures import k8s
from tests.fixtures.federation import ROOT


def _with_multi_gpu(tmp_path: Path, profile: str) -> list[dict[str, Any]]:
    here = tmp_path / profile
    here.mkdir()
    rel = os.path.relpath(k8s.K8S, here)
    (here / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [f"{rel}/overlays/{profile}"],
        "components": [f"{rel}/components/multi-gpu"]}))
    return k8s.render(here)


@pytest.mark.parametrize("profile", ["gpu-enforced", "hetero"])
def test_the_component_gives_each_gpu_site_several_gpus_and_cpu_sites_none(
        tmp_path: Path, profile: str) -> None:
    objects = _with_multi_gpu(tmp_path, profile)
    gpu_sites = 0
    for c in k8s.containers(objects):
        if c.init or k8s.role(c.workload) != "node":
            continue
        if k8s.gpu_policy(c.workload, objects) in ("offer", "enforce"):
            assert int(c.gpu_limit()) == 4, c.name
            gpu_sites += 1
        else:
            assert c.gpu_limit() is None, c.name
    assert gpu_sites >= 1
    for obj in objects:
        kubernetes_validate.validate(obj, "1.34", strict=True)


def test_compose_gpu_services_reserve_the_configured_count() -> None:
    doc = yaml.safe_load((ROOT / "compose" / "compose.yaml").read_text())
    reserved = [s["deploy"]["resources"]["reservations"]["devices"][0]
                for s in doc["services"].values()
                if "deploy" in s and "reservations" in s["deploy"].get("resources", {})]
    assert reserved and all(d["count"] == "${FEDGPU_GPU_COUNT:-1}" for d in reserved)
