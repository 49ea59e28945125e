"""The compose deployment from Python: Compose v2 runs the project (`up`/`down`), the Docker
SDK reads containers, health, GPU reservations, logs and the nodes' GPU decisions.

Every precondition (docker CLI, Compose v2, a reachable engine, a known profile, the images,
the NVIDIA toolkit for GPU profiles) is checked first and fails as one line with the fix.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedgpu.core.constants import NODE_STATUS_FILE, PROFILES
from fedgpu.core.errors import ConfigError, FedgpuError

PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"


def check_profile(profile: str | None) -> None:
    if profile is not None and profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r}: use one of {', '.join(PROFILES)} "
                          "(or none for the aggregator alone)")


def find_compose_file(given: Path | None) -> Path:
    if given is not None:
        if not given.is_file():
            raise ConfigError(f"compose file {given} does not exist")
        return given
    # The working directory's checkout first, then the one this package was installed from.
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        candidate = root / "compose" / "compose.yaml"
        if candidate.is_file():
            return candidate
    raise ConfigError("no compose/compose.yaml here: run from the fedgpu checkout, or give "
                      "--compose-file (FEDGPU_COMPOSE_FILE)")


def project_name(compose_file: Path, given: str | None) -> str:
    if given:
        return given
    if os.environ.get("COMPOSE_PROJECT_NAME"):
        return os.environ["COMPOSE_PROJECT_NAME"]
    m = re.search(r"^name:\s*['\"]?([\w.-]+)", compose_file.read_text(), re.M)
    # Compose's own default: the directory's name.
    return m.group(1) if m else compose_file.parent.name


def check_compose() -> None:
    if shutil.which("docker") is None:
        raise FedgpuError("no docker CLI on PATH: install Docker Engine with the Compose v2 "
                          "plugin (docker-compose-plugin); 'fedgpu doctor' checks the host")
    proc = subprocess.run(["docker", "compose", "version", "--short"], capture_output=True,
                          text=True, timeout=30)
    if proc.returncode != 0 or not re.match(r"v?([2-9]|\d\d)", proc.stdout.strip()):
        raise FedgpuError("no Docker Compose v2 ('docker compose'): install the "
                          "docker-compose-plugin package; 'fedgpu doctor' checks the host")


def engine() -> Any:
    try:
        import docker
    except ImportError:
        raise FedgpuError("the docker Python SDK is missing: pip install 'fedgpu[deploy]'"
                          ) from None
    host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    try:
        client = docker.from_env(timeout=10)
        client.ping()
    except Exception as exc:  # DockerException, connection and permission errors alike
        why = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise FedgpuError(f"no Docker engine answers at {host} ({why}): start it (sudo "
                          "systemctl start docker) or set DOCKER_HOST") from None
    return client


@dataclass
class Project:
    compose_file: Path
    name: str

    def compose_args(self, profiles: Sequence[str]) -> list[str]:
        args = ["docker", "compose", "-f", str(self.compose_file), "-p", self.name]
        for p in profiles:
            args += ["--profile", p]
        return args

    def compose(self, *args: str, profiles: Sequence[str] = (), capture: bool = False,
                timeout: float = 600) -> subprocess.CompletedProcess[str]:
        cmd = [*self.compose_args(profiles), *args]
        # Compose's own progress goes to our stderr: stdout is kept for what we print.
        proc = (subprocess.run(cmd, text=True, capture_output=True, timeout=timeout)
                if capture else subprocess.run(cmd, text=True, stdout=sys.stderr,
                                               timeout=timeout))
        if proc.returncode != 0:
            last = ((proc.stderr or "").strip().splitlines() or ["see its output above"])[-1]
            raise FedgpuError(f"docker compose {args[0]} failed (exit {proc.returncode}): "
                              f"{last}")
        return proc

    def services(self, profile: str | None) -> list[str]:
        out = self.compose("config", "--services", profiles=[profile] if profile else [],
                           capture=True).stdout
        return out.split()

    def images(self, profile: str | None) -> list[str]:
        out = self.compose("config", "--images", profiles=[profile] if profile else [],
                           capture=True).stdout
        return sorted(set(out.split()))

    def containers(self, client: Any, services: Sequence[str] | None = None) -> list[Any]:
        found = client.containers.list(all=True, filters={"label": f"{PROJECT_LABEL}={self.name}"})
        if services is not None:
            found = [c for c in found if c.labels.get(SERVICE_LABEL) in services]
        return sorted(found, key=lambda c: (c.labels.get(SERVICE_LABEL, ""), c.name))


def gpu_host_problem(client: Any, profile: str | None) -> str | None:
    """Why GPU services of this profile cannot get a GPU here, or None."""
    from fedgpu.cli.doctor import checks as doctor

    # The cpu and ring profiles reserve no GPU.
    if profile in (None, "cpu", "ring"):
        return None
    check = doctor.probe_nvidia_runtime(client.info(), doctor.FAIL)
    return None if check.status == doctor.OK else check.detail


def missing_images(client: Any, images: Sequence[str]) -> list[str]:
    import docker.errors

    missing = []
    for image in images:
        try:
            client.images.get(image)
        except docker.errors.ImageNotFound:
            missing.append(image)
    return missing


# ---- what `ps` shows ------------------------------------------------------------------


def gpu_reservation(container: Any) -> dict[str, Any] | None:
    requests = (container.attrs.get("HostConfig") or {}).get("DeviceRequests") or []
    for req in requests:
        caps = [c for group in (req.get("Capabilities") or []) for c in group]
        if req.get("Driver") == "nvidia" or "gpu" in caps:
            return {"driver": req.get("Driver") or None, "count": req.get("Count"),
                    "device_ids": req.get("DeviceIDs") or None, "capabilities": caps}
    return None


def read_file(container: Any, path: str) -> bytes | None:
    """A file from the container's filesystem (running or stopped), without exec."""
    try:
        stream, _ = container.get_archive(path)
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.next()
            fh = tar.extractfile(member) if member is not None else None
            return fh.read() if fh is not None else None
    except Exception:  # no such file yet, or the engine refused: nothing to show
        return None


def gpu_decision(container: Any) -> dict[str, Any] | None:
    raw = read_file(container, NODE_STATUS_FILE)
    if raw is None:
        return None
    try:
        return (json.loads(raw) or {}).get("gpu_decision")
    except ValueError:
        return None


def describe(container: Any) -> dict[str, Any]:
    state = container.attrs.get("State") or {}
    service = container.labels.get(SERVICE_LABEL, "")
    is_node = service.startswith("node-")
    doc: dict[str, Any] = {
        "service": service,
        "container": container.name,
        "state": state.get("Status"),
        "health": (state.get("Health") or {}).get("Status"),
        "exit_code": state.get("ExitCode") if state.get("Status") == "exited" else None,
        "image": (container.attrs.get("Config") or {}).get("Image"),
        "ports": sorted(f"{b['HostIp']}:{b['HostPort']}->{p}"
                        for p, binds in ((container.attrs.get("NetworkSettings") or {})
                                         .get("Ports") or {}).items() for b in binds or []),
        "gpu_reservation": gpu_reservation(container),
        "gpu_decision": gpu_decision(container) if is_node else None,
        "error": None,
    }
    if is_node and doc["exit_code"]:
        # A node that exits non-zero said why on its last line (e.g. --gpu enforce, no GPU).
        tail = container.logs(tail=5).decode(errors="replace").strip().splitlines()
        doc["error"] = tail[-1] if tail else None
    return doc


def ps(project: Project, client: Any, profile: str | None) -> dict[str, Any]:
    services = project.services(profile) if profile else None
    return {"project": project.name,
            "services": [describe(c) for c in project.containers(client, services)]}


# ---- logs -----------------------------------------------------------------------------


def _lines(container: Any, follow: bool, tail: int | str) -> Iterator[bytes]:
    buf = b""
    for chunk in container.logs(stream=True, follow=follow, tail=tail, timestamps=True):
        buf += chunk
        *lines, buf = buf.split(b"\n")
        yield from lines
    if buf:
        yield buf


def _split_ts(line: bytes) -> tuple[str, str]:
    text = line.decode(errors="replace")
    ts, _, rest = text.partition(" ")
    return ts, rest


def logs(project: Project, client: Any, services: Sequence[str] | None, follow: bool,
         tail: int | str, out: Any = sys.stdout) -> None:
    containers = project.containers(client, services)
    if not containers:
        raise FedgpuError(f"no containers in project {project.name}"
                          + (f" for {', '.join(services)}" if services else "")
                          + ": start it with 'fedgpu up --profile ...'")
    width = max(len(c.labels.get(SERVICE_LABEL, c.name)) for c in containers)

    def prefix(c: Any) -> str:
        return f"{c.labels.get(SERVICE_LABEL, c.name):<{width}} | "

    if not follow:
        # Interleaved by the engine's timestamps, as `docker compose logs` shows them.
        merged = sorted((ts, prefix(c), rest) for c in containers
                        for ts, rest in map(_split_ts, _lines(c, False, tail)))
        for _, pre, rest in merged:
            out.write(pre + rest + "\n")
        out.flush()
        return
    lock = threading.Lock()

    def pump(c: Any) -> None:
        for line in _lines(c, True, tail):
            with lock:
                out.write(prefix(c) + _split_ts(line)[1] + "\n")
                out.flush()

    threads = [threading.Thread(target=pump, args=(c,), daemon=True) for c in containers]
    for t in threads:
        t.start()
    # Until every container's stream ends (all stopped) or Ctrl-C.
    for t in threads:
        while t.is_alive():
            t.join(timeout=0.5)


@dataclass(frozen=True)
class ComposeConnection:
    """How the host's admin CLI reaches the compose aggregator: what `make up` and
    `fedgpu up` save as the connection "compose"."""

    address: str
    tls_ca: Path
    tls_cert: Path
    tls_key: Path
    token: str | None


def compose_connection(config: dict[str, Any], grpc_port: int = 50051) -> ComposeConnection:
    """From `docker compose config --format json` (variables resolved, paths absolute): the
    aggregator's published gRPC port, the certificate directory it mounts (its parent holds
    ca.crt and operators/operator/) and the operator token it was given."""
    try:
        agg = config["services"]["aggregator"]
    except (KeyError, TypeError):
        raise FedgpuError("the compose file has no aggregator service") from None
    port = next((p for p in agg.get("ports") or [] if isinstance(p, dict)
                 and str(p.get("target")) == str(grpc_port) and p.get("published")), None)
    if port is None:
        raise FedgpuError(f"the compose aggregator publishes no port for {grpc_port}: add one "
                          "to reach it from this host")
    host = port.get("host_ip") or "127.0.0.1"
    # Published on every interface: this host reaches it on loopback.
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    mount = next((v for v in agg.get("volumes") or [] if isinstance(v, dict)
                  and v.get("target") == "/certs" and v.get("source")), None)
    if mount is None:
        raise FedgpuError("the compose aggregator mounts no /certs: it runs without TLS "
                          "material made by the certs service")
    certs = Path(mount["source"]).parent
    operator = certs / "operators" / "operator"
    token = (agg.get("environment") or {}).get("FEDGPU_OPERATOR_TOKEN") or None
    return ComposeConnection(f"{host}:{port['published']}", certs / "ca.crt",
                             operator / "operator.crt", operator / "operator.key", token)


def operator_owner_env() -> dict[str, str]:
    """The compose certs service hands the operator's key pair to this user, so that the
    CLI here can read it (compose.yaml: FEDGPU_OPERATOR_UID/GID)."""
    return {"FEDGPU_OPERATOR_UID": str(os.getuid()), "FEDGPU_OPERATOR_GID": str(os.getgid())}


def save_connection(project: Project, name: str = "compose") -> str:
    """Save the compose aggregator as connection `name`, made the default; what to print."""
    from fedgpu.cli.common import connections
    from fedgpu.core.tls import from_options

    doc = json.loads(project.compose("config", "--format", "json", capture=True).stdout)
    found = compose_connection(doc)
    # Readable here only once the certs service gave the operator's pair to this user.
    from_options(found.tls_cert, found.tls_key, found.tls_ca)
    with connections.editing() as box:
        token_file = (connections.save_token(name, found.token) if found.token else None)
        box[0] = connections.put(box[0], connections.SavedConnection(
            name, found.address, tls_ca=found.tls_ca, tls_cert=found.tls_cert,
            tls_key=found.tls_key, token_file=token_file), make_default=True)
    return (f"saved connection {name!r} ({found.address}), the default: 'fedgpu status' "
            "asks this deployment")


def retire_connection(name: str = "compose") -> str | None:
    """Forget the connection save_connection made (its token file too) once the deployment is
    down, so the next command does not dial it; what to print, or None if there was none."""
    from fedgpu.cli.common import connections

    if connections.forget(name) is None:
        return None
    return f"removed connection {name!r} (the deployment is down)"
