"""`fedgpu doctor`: is this host ready to run a fedgpu deployment, and if not, what to fix.

Each check returns ok / warn / fail with the reason and the fix. The decisions are pure
functions of what was observed (engine info, an NVML snapshot, torch's CUDA build, a
certificate), so they are testable with plain data; the probes around them are thin.
NVML is read only through `fedgpu.node.nvml` (the one module that talks to the driver), and torch
is imported only for the CUDA check: an operator's laptop or the aggregator image lacks it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedgpu.cli.doctor.result import FAIL, OK, WARN, Check
from fedgpu.core.constants import CPU_PROFILES, PROFILES, Profile
from fedgpu.core.errors import ConfigError

# Where the NVIDIA Container Toolkit writes CDI specs when the engine does not say.
DEFAULT_CDI_DIRS = ("/etc/cdi", "/var/run/cdi")


def gpu_severity(profile: str | None) -> str | None:
    """How bad a missing GPU piece is for this profile; None: GPUs are not wanted at all."""
    if profile is None:
        return WARN
    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r}: one of {', '.join(PROFILES)}")
    if profile in CPU_PROFILES:
        return None
    return WARN if profile == Profile.GPU_OFFERED else FAIL


def _not_needed(name: str, what: str) -> Check:
    return Check(name, OK, f"{what}; not needed for a CPU-only profile")


# ---- Docker ---------------------------------------------------------------------------


def _docker_host() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def probe_engine() -> tuple[Check, dict[str, Any] | None]:
    """The engine check and, when it answered, its `docker info`."""
    try:
        import docker
    except ImportError:
        return Check("docker_engine", FAIL, "the docker Python SDK is not installed",
                     "pip install 'fedgpu[deploy]'"), None
    host = _docker_host()
    try:
        client = docker.from_env(timeout=5)
        try:
            client.ping()
            info = client.info()
        finally:
            client.close()
    except Exception as exc:  # the SDK raises DockerException, requests' and OS errors alike
        why = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        return Check(
            "docker_engine", FAIL, f"no Docker engine answers at {host}: {why}",
            "start the engine (sudo systemctl start docker), or point DOCKER_HOST at one; "
            "your user needs access to its socket (the 'docker' group)"), None
    return Check("docker_engine", OK,
                 f"Docker {info.get('ServerVersion', '?')} at {host} "
                 f"({info.get('OperatingSystem', '?')})"), info


def probe_compose() -> Check:
    if shutil.which("docker") is None:
        return Check("compose", FAIL, "no docker CLI on PATH",
                     "install the Docker CLI and its Compose v2 plugin (docker-compose-plugin)")
    try:
        proc = subprocess.run(["docker", "compose", "version", "--short"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("compose", FAIL, f"'docker compose version' did not run: {exc}",
                     "reinstall the Compose v2 plugin (docker-compose-plugin)")
    return compose_check(proc.returncode, proc.stdout.strip(), proc.stderr.strip())


def compose_check(returncode: int, stdout: str, stderr: str) -> Check:
    if returncode != 0:
        why = (stderr.splitlines() or ["no output"])[-1]
        return Check("compose", FAIL, f"'docker compose' is not available: {why}",
                     "install the Compose v2 plugin (docker-compose-plugin); the old "
                     "docker-compose v1 is not supported")
    version = stdout.lstrip("v")
    major = re.match(r"(\d+)", version)
    if major is None or int(major.group(1)) < 2:
        return Check("compose", FAIL, f"Compose {version or '?'} is too old: profiles and "
                     "GPU reservations need Compose v2", "install docker-compose-plugin v2")
    return Check("compose", OK, f"Docker Compose {version}")


def _cdi_nvidia(dirs: Sequence[str]) -> list[str]:
    found = []
    for d in dirs:
        path = Path(d)
        if not path.is_dir():
            continue
        for spec in sorted([*path.glob("*.yaml"), *path.glob("*.json")]):
            try:
                text = spec.read_text(errors="replace")
            except OSError:
                continue
            if "nvidia.com/gpu" in text:
                found.append(str(spec))
    return found


def nvidia_runtime_check(info: Mapping[str, Any] | None, severity: str | None,
                         local: bool, hook_on_path: bool, cdi_specs: Sequence[str]) -> Check:
    name = "nvidia_runtime"
    if severity is None:
        return _not_needed(name, "GPU containers not checked")
    if info is None:
        return Check(name, severity, "cannot tell: the Docker engine did not answer",
                     "fix docker_engine first")
    runtimes = sorted((info.get("Runtimes") or {}).keys())
    found = []
    if "nvidia" in runtimes:
        found.append("runtime 'nvidia' registered with the engine")
    if cdi_specs:
        found.append(f"CDI spec {', '.join(cdi_specs)}")
    # Compose's `driver: nvidia` reservations go through the toolkit's prestart hook, which
    # the engine finds on its own PATH: present without any runtime being registered.
    if hook_on_path and local:
        found.append("nvidia-container-runtime-hook on PATH")
    if found:
        return Check(name, OK, "; ".join(found))
    where = "" if local else " (remote engine: its host was not inspected)"
    return Check(
        name, severity,
        f"the engine has no NVIDIA runtime (runtimes: {', '.join(runtimes) or 'none'}) and no "
        f"NVIDIA CDI spec{where}: GPU services cannot get a GPU",
        "install the NVIDIA Container Toolkit, run 'sudo nvidia-ctk runtime configure "
        "--runtime=docker' and restart Docker (or 'nvidia-ctk cdi generate --output="
        "/etc/cdi/nvidia.yaml'); or use --profile cpu")


def probe_nvidia_runtime(info: Mapping[str, Any] | None, severity: str | None) -> Check:
    local = _docker_host().startswith("unix://")
    hook = bool(shutil.which("nvidia-container-runtime-hook") or
                shutil.which("nvidia-container-cli"))
    dirs = list((info or {}).get("CDISpecDirs") or DEFAULT_CDI_DIRS) if local else []
    return nvidia_runtime_check(info, severity, local, hook, _cdi_nvidia(dirs))


# ---- NVML, driver and torch -----------------------------------------------------------


def _nvml_fix(reason: str) -> str:
    if "nvidia-ml-py" in reason:
        return "pip install 'fedgpu[node]' (or run doctor inside the node image)"
    if "not found" in reason:
        return ("install the NVIDIA driver on the host; in a container, start it with the "
                "NVIDIA Container Toolkit (a GPU reservation or --gpus)")
    if "not loaded" in reason:
        return "load the driver (sudo modprobe nvidia); nvidia-smi must work on the host"
    if "permission" in reason:
        return "run as a user that may open /dev/nvidia* (e.g. the 'video' group)"
    if "mismatch" in reason:
        return "reboot the host after the driver upgrade"
    return "run nvidia-smi on the host: it prints the driver's own error"


def nvml_check(snap: Any, severity: str | None) -> Check:
    name = "nvml"
    if snap.available:
        return Check(name, OK, f"NVML loaded: driver {snap.driver_version or '?'}, supports "
                     f"CUDA {snap.cuda_driver_version or '?'}")
    if severity is None:
        return _not_needed(name, f"NVML unavailable ({snap.reason})")
    return Check(name, severity, f"NVML unavailable: {snap.reason}", _nvml_fix(snap.reason))


def _version(v: str | None) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", v or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def cuda_check(driver_cuda: str | None, torch_cuda: str | None, torch_version: str | None,
               gpus: int, severity: str | None) -> Check:
    """The driver must support the CUDA version torch was built for."""
    name = "cuda_compat"
    if torch_version is None:
        return Check(name, OK if severity is None else WARN,
                     "torch is not installed here, so there is no CUDA build to compare "
                     "(fine on an aggregator or operator host)",
                     None if severity is None else "run doctor on the node hosts or in the "
                     "node image: docker compose run --rm node-gpu-offered-1 doctor")
    if torch_cuda is None:
        if gpus and severity is not None:
            return Check(name, WARN, f"torch {torch_version} is a CPU build: nodes here will "
                         f"train on the CPU although {gpus} GPU(s) are visible",
                         "install a CUDA build of torch (pip install torch --index-url "
                         "https://download.pytorch.org/whl/cu124) or use the node image")
        return Check(name, OK, f"torch {torch_version} is a CPU build; no GPU training here")
    have, need = _version(driver_cuda), _version(torch_cuda)
    if have is None:
        if severity is None:
            return _not_needed(name, f"torch built for CUDA {torch_cuda}; no driver")
        return Check(name, severity, f"torch is built for CUDA {torch_cuda} but no NVIDIA "
                     "driver answered (see nvml)", "fix nvml first")
    assert need is not None
    detail = f"driver supports CUDA {driver_cuda}, torch {torch_version} is built for {torch_cuda}"
    if have >= need:
        return Check(name, OK, detail)
    fix = (f"upgrade the NVIDIA driver to one that supports CUDA {torch_cuda} (see NVIDIA's "
           f"CUDA compatibility table), or install a torch build for CUDA {driver_cuda} or older")
    if have[0] < need[0]:
        # A node that offers this GPU would pick it and then fail every round.
        return Check(name, WARN if severity is None else FAIL,
                     f"{detail}: this driver is too old, CUDA will not initialise", fix)
    # Same major version: CUDA's minor-version compatibility runs most kernels, but PTX
    # JIT and newer APIs fail.
    return Check(name, WARN, f"{detail}: runs under minor-version compatibility only", fix)


def torch_cuda() -> tuple[str | None, str | None]:
    """(torch version, the CUDA version it was built for) or (None, None) without torch."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None:
        return None, None
    # torch/version.py is generated at build time and imports nothing: reading it alone is
    # instant, while `import torch` takes seconds and loads the CUDA runtime libraries.
    for location in spec.submodule_search_locations or ():
        path = Path(location) / "version.py"
        vspec = importlib.util.spec_from_file_location("_fedgpu_torch_version", path)
        if path.exists() and vspec is not None and vspec.loader is not None:
            module = importlib.util.module_from_spec(vspec)
            try:
                vspec.loader.exec_module(module)
            except Exception:  # an unusual build: fall back to the real import below
                break
            return str(getattr(module, "__version__", "?")), getattr(module, "cuda", None)
    import torch

    return str(torch.__version__), torch.version.cuda


def gpus_check(snap: Any, severity: str | None) -> Check:
    name = "gpus"
    if not snap.available:
        if severity is None:
            return _not_needed(name, "no GPU visible")
        return Check(name, severity, "no GPU visible: NVML is unavailable (see nvml)",
                     "fix nvml first")
    healthy = [g for g in snap.gpus if g.healthy]
    sick = [g for g in snap.gpus if not g.healthy]
    listing = "; ".join(f"{g.index}: {g.name or '?'} {g.memory_free_mib}/"
                        f"{g.memory_total_mib} MiB free" for g in healthy)
    if sick:
        return Check(name, WARN if healthy else (severity or WARN),
                     f"{len(healthy)} healthy GPU(s) ({listing or 'none'}); unhealthy: "
                     + "; ".join(f"{g.index}: {g.reason}" for g in sick),
                     "see the unhealthy GPU's reason; nodes never pick an unhealthy GPU")
    if not healthy:
        if severity is None:
            return _not_needed(name, "NVML sees no GPU")
        return Check(name, severity, f"NVML works but sees no GPU ({snap.reason})",
                     "check CUDA_VISIBLE_DEVICES, and that the container was given GPUs "
                     "(deploy.resources.reservations.devices)")
    return Check(name, OK, f"{len(healthy)} GPU(s): {listing}")


# ---- all of it ------------------------------------------------------------------------


def run_checks(profile: str | None = None, address: str | None = None,
               token: str | None = None, tls: Any = None,
               operator_token: str | None = None) -> list[Check]:
    severity = gpu_severity(profile)
    engine, info = probe_engine()
    checks = [engine, probe_compose(), probe_nvidia_runtime(info, severity)]
    from fedgpu.node import nvml

    snap = nvml.snapshot()
    checks.append(nvml_check(snap, severity))
    torch_version, built_for = torch_cuda()
    checks.append(cuda_check(snap.cuda_driver_version, built_for, torch_version,
                             sum(g.healthy for g in snap.gpus), severity))
    checks.append(gpus_check(snap, severity))
    if address is not None:
        from fedgpu.cli.doctor.aggregator import aggregator_check

        checks.append(aggregator_check(address, token, tls, operator_token))
        if checks[-1].status != FAIL:
            from fedgpu.cli.doctor.bulk import bulk_check

            checks.append(bulk_check(address, token, tls, operator_token))
    if tls is not None:
        if tls.cert is not None:
            from fedgpu.cli.doctor.certs import cert_check

            checks.append(cert_check("cert", tls.cert, tls.ca, tls.key))
        if tls.ca is not None:
            from fedgpu.cli.doctor.certs import cert_check

            checks.append(cert_check("ca", tls.ca, None, None))
    return checks


def document(checks: Sequence[Check]) -> dict[str, Any]:
    return {"checks": [c.to_dict() for c in checks], "ok": all(c.status != FAIL for c in checks)}
