"""Compose gives every node its site's policy the same way (docs/how-to/site-policies.md, "With
compose"): FEDGPU_NODE_POLICY passes through, empty by default (no policy, as before), and set
to /certs/policy.toml each node reads the file in its own certificate folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.fixtures import k8s
from tests.fixtures.federation import ROOT


def _node_services() -> dict[str, dict]:
    services = yaml.safe_load((ROOT / "compose" / "compose.yaml").read_text())["services"]
    return {n: s for n, s in services.items() if n.startswith("node-")}


def test_every_node_passes_the_policy_variable_through_empty_by_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = _node_services()
    assert len(nodes) >= 12
    for name, svc in nodes.items():
        assert svc["environment"]["FEDGPU_NODE_POLICY"] == "${FEDGPU_NODE_POLICY:-}", name
        # /certs is the node's own folder, so /certs/policy.toml is its own file.
        certs = [v.rsplit(":", 2) for v in svc["volumes"] if v.endswith(":/certs:ro")]
        assert certs == [["${FEDGPU_CERTS_DIR:-./certs}/nodes/" + name, "/certs", "ro"]], name
    # Unset, compose passes "": `node start` then reads no policy, as before the variable.
    _, params = k8s.parse_cli(["node", "start"], {"FEDGPU_NODE_POLICY": ""}, monkeypatch)
    assert params["policy_file"] is None
    _, params = k8s.parse_cli(["node", "start"], {"FEDGPU_NODE_POLICY": "/certs/policy.toml"},
                              monkeypatch)
    assert params["policy_file"] == Path("/certs/policy.toml")
