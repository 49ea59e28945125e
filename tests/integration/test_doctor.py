"""`fedgpu doctor` as an operator runs it: a subprocess against the fake libnvidia-ml.so.1, a
stand-in torch build (only its version.py, as a wheel lays it out), a dead or a live Docker
engine, real certificates and a real aggregator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fedgpu.core import certs
from tests.e2e.dockerutil import engine_available
from tests.fixtures.fake_nvml import FakeNvml
from tests.fixtures.federation import ROOT, Federation, base_env, free_port, write_job
from tests.fixtures.forwarder import GrpcOnlyForwarder

GPU = {"name": "NVIDIA A100-SXM4-40GB", "memory_total_mib": 40960, "memory_used_mib": 1000,
       "compute_capability": "8.0"}
NAMES = ["docker_engine", "compose", "nvidia_runtime", "nvml", "cuda_compat", "gpus"]


def fake_torch(root: Path, cuda: str | None) -> Path:
    """A torch whose version.py says it was built for `cuda`; importing the package itself
    fails, which proves doctor reads the build without initialising torch."""
    pkg = root / "torch"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("raise ImportError('doctor must not import torch')\n")
    tag = "cpu" if cuda is None else "cu" + cuda.replace(".", "")
    (pkg / "version.py").write_text(f"__version__ = '2.4.0+{tag}'\ncuda = {cuda!r}\n")
    return root


def doctor(env: dict[str, str], *args: str) -> tuple[int, dict[str, Any]]:
    r = subprocess.run([sys.executable, "-m", "fedgpu.cli.app", "doctor", "--json", *args],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    doc = json.loads(r.stdout)  # stdout is exactly one JSON document
    assert set(doc) == {"checks", "ok"}
    for c in doc["checks"]:
        assert set(c) == {"name", "status", "detail", "fix"}
        assert c["status"] in ("ok", "warn", "fail") and c["detail"]
        # Every problem says what to do about it.
        assert c["status"] == "ok" or c["fix"], c
    assert doc["ok"] == all(c["status"] != "fail" for c in doc["checks"])
    assert r.returncode == (0 if doc["ok"] else 1), r.stderr
    return r.returncode, doc


def by_name(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["checks"]}


@pytest.fixture
def env_for(fake_nvml: FakeNvml, tmp_path: Path):
    """Environment: fake NVML (or none), a fake torch build, and a dead Docker socket unless
    `engine` is asked for."""

    def make(torch_cuda: str | None = "12.1", library: bool = True,
             engine: bool = False) -> dict[str, str]:
        env = fake_nvml.env() if library else fake_nvml.env_without_library()
        env["PYTHONPATH"] = f"{fake_torch(tmp_path / 'torch-site', torch_cuda)}:{ROOT}"
        env.pop("FEDGPU_TOKEN", None)
        env.pop("FEDGPU_OPERATOR_TOKEN", None)
        if not engine:
            env["DOCKER_HOST"] = f"unix://{tmp_path}/no-engine.sock"
        return env

    return make


def test_without_engine(env_for: Any, fake_nvml: FakeNvml, tmp_path: Path) -> None:
    fake_nvml.write([GPU])
    rc, doc = doctor(env_for())
    assert [c["name"] for c in doc["checks"]] == NAMES  # in order; no --address, no TLS
    checks = by_name(doc)
    assert rc == 1 and not doc["ok"]
    assert checks["docker_engine"]["status"] == "fail"
    assert f"unix://{tmp_path}/no-engine.sock" in checks["docker_engine"]["detail"]
    assert "DOCKER_HOST" in checks["docker_engine"]["fix"]
    # The runtime question cannot be answered without an engine, and says so.
    assert checks["nvidia_runtime"]["status"] == "warn"
    assert "did not answer" in checks["nvidia_runtime"]["detail"]
    # The rest of the host is still examined.
    assert checks["nvml"]["status"] == "ok" and checks["gpus"]["status"] == "ok"


def test_with_engine(env_for: Any, fake_nvml: FakeNvml) -> None:
    reason = engine_available()
    if reason:
        pytest.skip(reason)
    fake_nvml.write([GPU])
    rc, doc = doctor(env_for(engine=True), "--profile", "cpu")
    checks = by_name(doc)
    assert checks["docker_engine"]["status"] == "ok"
    assert checks["docker_engine"]["detail"].startswith("Docker ")
    assert checks["compose"]["status"] == "ok" and "Compose 2." in checks["compose"]["detail"]
    # With profile cpu nothing GPU-related can fail, so a working engine means exit 0.
    assert rc == 0 and doc["ok"]
    # An engine without the NVIDIA toolkit cannot serve GPU profiles: named, and a fail
    # where GPUs are required.
    rc, doc = doctor(env_for(engine=True), "--profile", "gpu-enforced")
    runtime = by_name(doc)["nvidia_runtime"]
    if runtime["status"] != "ok":
        assert runtime["status"] == "fail" and rc == 1
        assert "nvidia-ctk" in runtime["fix"]


def test_no_nvml_library(env_for: Any, fake_nvml: FakeNvml) -> None:
    probe = "import ctypes; ctypes.CDLL('libnvidia-ml.so.1')"
    if fake_nvml.run(["-c", probe], fake_nvml.env_without_library()).returncode == 0:
        pytest.skip("this host has a real libnvidia-ml.so.1, so 'no library' cannot be staged")
    for profile, expected in ((None, "warn"), ("gpu-offered", "warn"),
                              ("gpu-enforced", "fail"), ("hetero", "fail"), ("cpu", "ok")):
        _, doc = doctor(env_for(library=False), *(["--profile", profile] if profile else []))
        checks = by_name(doc)
        assert checks["nvml"]["status"] == expected, profile
        assert "libnvidia-ml.so.1 not found" in checks["nvml"]["detail"]
        assert checks["gpus"]["status"] == expected, profile
        if expected != "ok":
            assert "NVIDIA Container Toolkit" in checks["nvml"]["fix"]


def test_driver_not_loaded(env_for: Any, fake_nvml: FakeNvml) -> None:
    fake_nvml.write([GPU], init_error="driver_not_loaded")
    _, doc = doctor(env_for(), "--profile", "gpu-enforced")
    nvml = by_name(doc)["nvml"]
    assert nvml["status"] == "fail"
    assert "driver is not loaded" in nvml["detail"] and "modprobe" in nvml["fix"]
    # No driver answered, so the CUDA comparison cannot pass either.
    assert by_name(doc)["cuda_compat"]["status"] == "fail"


def test_zero_gpus(env_for: Any, fake_nvml: FakeNvml) -> None:
    fake_nvml.write([])
    _, doc = doctor(env_for(), "--profile", "gpu-enforced")
    checks = by_name(doc)
    assert checks["nvml"]["status"] == "ok" and "driver 550.54.15" in checks["nvml"]["detail"]
    assert checks["gpus"]["status"] == "fail"
    assert "sees no GPU" in checks["gpus"]["detail"]
    assert "reservations" in checks["gpus"]["fix"]


def test_gpus_present(env_for: Any, fake_nvml: FakeNvml) -> None:
    fake_nvml.write([GPU, {**GPU, "memory_used_mib": 30000}])
    _, doc = doctor(env_for(torch_cuda="12.1"), "--profile", "gpu-enforced")
    checks = by_name(doc)
    assert checks["gpus"]["status"] == "ok"
    assert checks["gpus"]["detail"].startswith("2 GPU(s)")
    assert "39960/40960 MiB free" in checks["gpus"]["detail"]
    assert checks["cuda_compat"]["status"] == "ok"
    assert "supports CUDA 12.4" in checks["cuda_compat"]["detail"]
    assert "built for 12.1" in checks["cuda_compat"]["detail"]
    # A lost GPU is reported with its reason while the healthy one still counts.
    fake_nvml.write([GPU, {**GPU, "lost": True}])
    gpus = by_name(doctor(env_for(), "--profile", "gpu-enforced")[1])["gpus"]
    assert gpus["status"] == "warn" and "1 healthy GPU(s)" in gpus["detail"]
    assert "unhealthy" in gpus["detail"]


@pytest.mark.parametrize(("driver_cuda", "torch_cuda", "expected"), [
    (11040, "12.1", "fail"),  # older major: CUDA cannot initialise
    (12020, "12.4", "warn"),  # same major, older minor: minor-version compatibility only
    (12040, "12.4", "ok"),
    (12060, "11.8", "ok"),
])
def test_driver_vs_torch_cuda(env_for: Any, fake_nvml: FakeNvml, driver_cuda: int,
                              torch_cuda: str, expected: str) -> None:
    fake_nvml.write([GPU], cuda=driver_cuda)
    _, doc = doctor(env_for(torch_cuda=torch_cuda))
    check = by_name(doc)["cuda_compat"]
    assert check["status"] == expected, check
    major, minor = divmod(driver_cuda // 10, 100)
    assert f"driver supports CUDA {major}.{minor}" in check["detail"]
    if expected != "ok":
        assert f"supports CUDA {torch_cuda}" in check["fix"]


def test_cpu_torch_build(env_for: Any, fake_nvml: FakeNvml) -> None:
    fake_nvml.write([GPU])
    check = by_name(doctor(env_for(torch_cuda=None))[1])["cuda_compat"]
    assert check["status"] == "warn" and "CPU build" in check["detail"]
    fake_nvml.write([])
    check = by_name(doctor(env_for(torch_cuda=None))[1])["cuda_compat"]
    assert check["status"] == "ok" and "CPU build" in check["detail"]


def test_aggregator(env_for: Any, fake_nvml: FakeNvml, federation: Federation,
                    tmp_path: Path) -> None:
    fake_nvml.write([GPU])
    dead = f"127.0.0.1:{free_port()}"
    check = by_name(doctor(env_for(), "--address", dead)[1])["aggregator"]
    assert check["status"] == "fail" and f"cannot reach aggregator at {dead}" in check["detail"]
    federation.start_server(write_job(tmp_path / "job.toml"))
    env = env_for()
    _, doc = doctor(env, "--address", federation.address)
    assert [c["name"] for c in doc["checks"]][-2:] == ["aggregator", "bulk_port"]
    check = by_name(doc)["aggregator"]
    assert check["status"] == "ok" and "SERVING" in check["detail"]
    env["FEDGPU_TOKEN"] = federation.token
    check = by_name(doctor(env, "--address", federation.address)[1])["aggregator"]
    assert check["status"] == "ok" and "accepts this node's credential" in check["detail"]
    env["FEDGPU_TOKEN"] = "wrong"
    check = by_name(doctor(env, "--address", federation.address)[1])["aggregator"]
    assert check["status"] == "warn" and "wrong token" in check["detail"]
    env["FEDGPU_OPERATOR_TOKEN"] = federation.operator_token
    check = by_name(doctor(env, "--address", federation.address)[1])["aggregator"]
    assert check["status"] == "ok" and "waiting, round 0/2" in check["detail"]
    env["FEDGPU_OPERATOR_TOKEN"] = "wrong"
    check = by_name(doctor(env, "--address", federation.address)[1])["aggregator"]
    assert check["status"] == "warn" and "wrong token" in check["detail"]


def test_tls_material(env_for: Any, fake_nvml: FakeNvml, tmp_path: Path) -> None:
    fake_nvml.write([GPU])
    ca = tmp_path / "pki"
    certs.init_ca(ca)
    good = certs.issue_node(ca, "site-a")
    soon = certs.issue_node(ca, "site-b", days=10)
    expired = certs.issue_node(ca, "site-c", days=0)
    other = tmp_path / "other-pki"
    certs.init_ca(other)

    def tls_checks(cert: Path, key: Path, ca_file: Path) -> dict[str, dict[str, Any]]:
        _, doc = doctor(env_for(), "--tls-cert", str(cert), "--tls-key", str(key),
                        "--tls-ca", str(ca_file))
        assert [c["name"] for c in doc["checks"]][-2:] == ["tls_cert", "tls_ca"]
        return by_name(doc)

    checks = tls_checks(good.cert, good.key, good.ca)
    assert checks["tls_cert"]["status"] == "ok" and "CN=site-a" in checks["tls_cert"]["detail"]
    assert checks["tls_ca"]["status"] == "ok"
    checks = tls_checks(soon.cert, soon.key, soon.ca)
    assert checks["tls_cert"]["status"] == "warn"
    assert "expires within 30 days" in checks["tls_cert"]["detail"]
    checks = tls_checks(expired.cert, expired.key, expired.ca)
    assert checks["tls_cert"]["status"] == "fail" and "expired" in checks["tls_cert"]["detail"]
    checks = tls_checks(good.cert, good.key, other / "ca.crt")
    assert checks["tls_cert"]["status"] == "fail"
    assert "not signed by" in checks["tls_cert"]["detail"]
    checks = tls_checks(good.cert, soon.key, good.ca)
    assert checks["tls_cert"]["status"] == "fail"
    assert "is not the key of" in checks["tls_cert"]["detail"]


def test_bad_flags(env_for: Any) -> None:
    r = subprocess.run([sys.executable, "-m", "fedgpu.cli.app", "doctor", "--profile", "gpu"],
                       capture_output=True, text=True, env=base_env(), cwd=ROOT, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == ("error: unknown profile 'gpu': one of cpu, gpu-offered, "
                                "gpu-enforced, hetero, ring")


def test_bulk_port(env_for: Any, fake_nvml: FakeNvml, federation: Federation,
                   tmp_path: Path) -> None:
    fake_nvml.write([GPU])
    bulk_port = free_port()
    federation.start_server(write_job(tmp_path / "job.toml"), "--bulk-port", str(bulk_port))
    env = env_for()
    env["FEDGPU_TOKEN"] = federation.token
    check = by_name(doctor(env, "--address", federation.address)[1])["bulk_port"]
    assert check["status"] == "ok", check
    assert f"bulk port 127.0.0.1:{bulk_port} reachable" in check["detail"]
    # The probe is not a refusal in the aggregator's counters.
    status = federation.query("GetStatus")["bulk"]
    assert status["refused"] == {} and status["port"] == bulk_port
    # Behind a firewall that lets the gRPC port through and nothing else.
    fw = GrpcOnlyForwarder(("127.0.0.1", int(federation.address.rsplit(":", 1)[1])))
    try:
        rc, doc = doctor(env, "--address", f"127.0.0.2:{fw.port}")
    finally:
        fw.close()
    check = by_name(doc)["bulk_port"]
    assert check["status"] == "warn" and "move weights over gRPC" in check["detail"], check
    assert f"open TCP port {bulk_port}" in check["fix"]
    assert by_name(doc)["aggregator"]["status"] == "ok"
