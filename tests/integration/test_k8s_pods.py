"""The cpu overlay's pods, run as real processes on loopback: what a cluster would run, short of
the cluster. Each pod gets its rendered args and environment, its Secret's files as written by
`fedgpu certs k8s-secrets`, its ConfigMaps and volumes as directories (mount paths mapped into a
temporary folder, "aggregator:50051" and the health port onto free loopback ports). Then the
demo-data init containers write the partitions, the aggregator's grpc probe (a plaintext
grpc.health.v1 check on the health port, as the kubelet makes it) answers SERVING, and the nodes
register under their sites' names with their own certificates and start the run."""

from __future__ import annotations

import base64
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from fedgpu.core import admin_client, certs
from fedgpu.core.errors import FedgpuError
from fedgpu.core.tls import from_options
from tests.fixtures import k8s
from tests.fixtures.federation import FEDGPU, ROOT, Federation, base_env, cli, free_port

TOKEN = "k8s-token"


class Pod:
    """One workload's main (or init) container as a local process."""

    def __init__(self, tmp: Path, workload: dict[str, Any], objects: list[dict[str, Any]],
                 secrets: dict[str, dict[str, Any]], port: int) -> None:
        self.workload, self.objects, self.secrets, self.port = workload, objects, secrets, port
        self.health_port = free_port()
        self.root = tmp / workload["metadata"]["name"]
        self.mounts: dict[str, Path] = {"/tmp": self.root / "tmp"}
        spec = workload["spec"]["template"]["spec"]
        for volume in spec["volumes"]:
            where = self.root / "volumes" / volume["name"]
            where.mkdir(parents=True, exist_ok=True)
            if "secret" in volume:
                for key, value in secrets[volume["secret"]["secretName"]]["data"].items():
                    (where / key).write_bytes(base64.b64decode(value))
                    (where / key).chmod(0o600)
            elif "configMap" in volume:
                (cm,) = [o for o in k8s.by_kind(objects, "ConfigMap")
                         if o["metadata"]["name"] == volume["configMap"]["name"]]
                for key, value in cm["data"].items():
                    (where / key).write_text(value)
        self.mounts["/tmp"].mkdir(parents=True)
        # The StatefulSet's claim template is a volume too.
        for claim in workload["spec"].get("volumeClaimTemplates", []):
            (self.root / "volumes" / claim["metadata"]["name"]).mkdir(parents=True)

    def env_and_argv(self, c: k8s.Container, argv: list[str]) -> tuple[dict[str, str], list[str]]:
        values = {name: {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
                  for name, secret in self.secrets.items()}
        env = k8s.environment(c, self.objects, values)
        for m in c.spec.get("volumeMounts", []):
            source = self.root / "volumes" / m["name"]
            if "subPathExpr" in m:
                source = source / m["subPathExpr"].replace(
                    "$(FEDGPU_DEMO_PARTITION)", env["FEDGPU_DEMO_PARTITION"])
            self.mounts[m["mountPath"]] = source
        # Longest mount path first, so /certs/x never matches a shorter prefix.
        prefixes = sorted(self.mounts, key=len, reverse=True)

        def local(value: str) -> str:
            value = value.replace("aggregator:50051", f"127.0.0.1:{self.port}")
            value = value.replace("127.0.0.1:50051", f"127.0.0.1:{self.port}")
            value = "127.0.0.1" if value == "0.0.0.0" else value  # loopback only, in tests
            for prefix in prefixes:
                if value == prefix or value.startswith(prefix + "/"):
                    return str(self.mounts[prefix]) + value[len(prefix):]
            return value

        env = {k: local(v) for k, v in env.items()}
        if "FEDGPU_PORT" in env:
            env["FEDGPU_PORT"] = str(self.port)
            env["FEDGPU_METRICS_PORT"] = "0"  # no second fixed port on a shared machine
        if "FEDGPU_HEALTH_PORT" in env:
            env["FEDGPU_HEALTH_PORT"] = str(self.health_port)
        # The pod's private /tmp: the agent's status file and round directories go there.
        env["FEDGPU_NODE_STATUS"] = str(self.mounts["/tmp"] / "fedgpu-node-status.json")
        env["TMPDIR"] = str(self.mounts["/tmp"])
        full = base_env()
        for name in [n for n in full if n.startswith("FEDGPU_")]:
            del full[name]
        full.update(env)
        return full, [local(a) for a in argv]


def test_the_cpu_overlays_pods_run_a_federation(tmp_path: Path) -> None:
    objects = k8s.overlay("cpu")
    # The deployment's TLS material and its Secrets, from the real CLI.
    ca_dir = tmp_path / "certs"
    certs.init_ca(ca_dir)
    certs.issue_server(ca_dir, sans=["aggregator", "localhost", "127.0.0.1"])
    sites = [k8s.site(w) for w in k8s.node_workloads(objects)]
    for name in sites:
        certs.issue_node(ca_dir, name)
    r = cli("certs", "k8s-secrets", "--dir", str(ca_dir), "--out", str(tmp_path / "secrets"),
            token=TOKEN)
    assert r.returncode == 0, r.stderr
    secrets = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "secrets").glob("*.json")}

    port = free_port()
    fed = Federation(tmp_path, token=TOKEN, address=f"127.0.0.1:{port}")
    try:
        (sts,) = k8s.by_kind(objects, "StatefulSet")
        aggregator = Pod(tmp_path / "pods", sts, objects, secrets, port)
        main = k8s.main_container(sts)
        env, argv = aggregator.env_and_argv(main, main.spec["args"])
        proc = fed.spawn("aggregator", argv, env=env)
        # The readiness probe as the kubelet makes it: grpc.health.v1 Check, plaintext, on the
        # probe's port (mapped to this pod's free health port), default service "".
        probe = main.spec["readinessProbe"]["grpc"]
        assert k8s.environment(main, objects)["FEDGPU_HEALTH_PORT"] == str(probe["port"])
        deadline = time.monotonic() + 120
        status = ""
        while status != "SERVING":
            try:
                status = admin_client.health(f"127.0.0.1:{aggregator.health_port}",
                                             probe.get("service", ""), timeout=5)
            except FedgpuError as exc:
                status = str(exc)
            assert proc.popen.poll() is None, proc.text()[-2000:]
            assert time.monotonic() < deadline, f"probe never passed: {status}"
            if status != "SERVING":
                time.sleep(1)

        pods = {}
        for w in k8s.node_workloads(objects):
            pod = pods[k8s.site(w)] = Pod(tmp_path / "pods", w, objects, secrets, port)
            (init,) = [c for c in k8s.containers([w]) if c.init]
            env, argv = pod.env_and_argv(init, init.spec["args"])
            done = subprocess.run([*FEDGPU, *argv], env=env, cwd=ROOT, capture_output=True,
                                  text=True, timeout=300)
            assert done.returncode == 0, done.stderr
            main = k8s.main_container(w)
            env, argv = pod.env_and_argv(main, main.spec["args"])
            fed.spawn(k8s.site(w), argv, env=env)

        # An operator with the operator's certificate sees the nodes under their sites' names
        # (mutual TLS admits a node only under its certificate's name, from its own Secret).
        issued = certs.issue_operator(ca_dir)
        fed.tls = from_options(issued.cert, issued.key, issued.ca)
        deadline = time.monotonic() + 300
        names: list[str] = []
        last_error = ""
        while time.monotonic() < deadline:
            try:
                doc = fed.query("ListNodes")
                names = sorted(n["name"] for n in doc["nodes"] if n["alive"])
            except FedgpuError as exc:
                last_error = str(exc)
            if names == sorted(sites):
                break
            time.sleep(1)
        logs = "\n".join(f"--- {p.name}\n{p.text()[-1500:]}" for p in fed.procs)
        assert names == sorted(sites), f"registered {names} ({last_error})\n{logs}"
        # The run starts with them (min_nodes = 3): nothing refused their data or names.
        fed.wait_state(("running", "finished"), timeout=300)
        # Each node's readiness probe, as the kubelet would exec it in that pod.
        for w in k8s.node_workloads(objects):
            pod = pods[k8s.site(w)]
            main = k8s.main_container(w)
            env, probe = pod.env_and_argv(main, main.spec["readinessProbe"]["exec"]["command"][1:])
            out = subprocess.run([*FEDGPU, *probe], env=env, cwd=ROOT, capture_output=True,
                                 text=True, timeout=120)
            assert out.returncode == 0 and out.stdout.startswith("healthy"), out.stderr
        # Each node's data mount is its own partition of the demo split (node-1 .. node-3).
        for w in k8s.node_workloads(objects):
            part = w["spec"]["template"]["metadata"]["labels"]["fedgpu.io/demo-partition"]
            meta = tmp_path / "pods" / w["metadata"]["name"] / "volumes" / "data" / f"node-{part}"
            assert json.loads((meta / "meta.json").read_text())["node"] == int(part)
    finally:
        fed.stop()
