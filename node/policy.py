"""GPU policy of a node: which device a round trains on, and why.

Pure functions of NVML records and the node's flags (no NVML here), so every cell of the
policy table in DESIGN.md is tested with plain data. The devices are
`gpu_records.training_devices`: whole GPUs, and the MIG devices of a GPU in MIG mode in its
place, chosen by the same rule (most free memory). Choosing several devices for one round:
node/device_choice.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, cast, get_args

from fedgpu.core import admission
from fedgpu.core.constants import GpuMode, GpuNeed
from fedgpu.core.job.resources import Resources
from fedgpu.node.gpu_records import has_room, label, rank, training_devices
from fedgpu.node.nvml import GpuRecord, NvmlSnapshot

Mode = Literal["none", "offer", "enforce"]
MODES: tuple[str, ...] = get_args(Mode)

_GPU_UUID = re.compile(r"^GPU-[0-9a-fA-F-]+$")
_MIG_UUID = re.compile(r"^MIG-[0-9A-Za-z/-]+$")

_NO_GPU_HINT = (
    "is the NVIDIA Container Toolkit installed and the service given a GPU "
    "(--gpus / deploy.resources.reservations.devices)?"
)


class PolicyError(ValueError):
    """Bad GPU flags; the message is one line, fit for the CLI."""


class EnforceError(RuntimeError):
    """``--gpu enforce`` and no usable GPU; the message names the likely cause."""


class Ineligible(Exception):
    """This node cannot take the job now (its [resources] against the live GPUs and the
    site's policy); the message is the reason sent to the aggregator."""


@dataclass(frozen=True)
class GpuFlags:
    mode: Mode
    index: str | None = None
    min_free_mib: int = 0
    memory_fraction: float | None = None


def parse_gpu_flags(
    mode: str, index: str | None, min_free_mib: int, memory_fraction: float | None
) -> GpuFlags:
    """Validates the node's ``--gpu*`` flags."""
    mode = mode.strip().lower()
    if mode not in MODES:
        raise PolicyError(f"--gpu must be one of {', '.join(MODES)}, not {mode!r}")
    if index is not None:
        index = index.strip()
        if not (index.isdigit() or _GPU_UUID.match(index) or _MIG_UUID.match(index)):
            raise PolicyError(
                f"--gpu-index must be a GPU index (0, 1, ...) or a UUID (GPU-..., MIG-...), "
                f"not {index!r}"
            )
    if min_free_mib < 0:
        raise PolicyError(f"--gpu-min-free-mib must be >= 0, not {min_free_mib}")
    if memory_fraction is not None and not 0.0 < memory_fraction <= 1.0:
        raise PolicyError(f"--gpu-memory-fraction must be in (0, 1], not {memory_fraction}")
    return GpuFlags(cast(Mode, mode), index, min_free_mib, memory_fraction)


@dataclass(frozen=True)
class Decision:
    mode: Mode
    use_gpu: bool
    device: Literal["cuda", "cpu"]
    gpu_index: int | None
    gpu_uuid: str | None
    gpu_name: str | None
    memory_fraction: float | None
    reason: str
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "use_gpu": self.use_gpu,
            "device": self.device,
            "gpu_index": self.gpu_index,
            "gpu_uuid": self.gpu_uuid,
            "gpu_name": self.gpu_name,
            "memory_fraction": self.memory_fraction,
            "reason": self.reason,
            "warnings": list(self.warnings),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Decision:
        if data["mode"] not in MODES or data["device"] not in ("cuda", "cpu"):
            raise ValueError(f"not a GPU decision: mode={data['mode']!r} device={data['device']!r}")
        return cls(
            mode=data["mode"],
            use_gpu=bool(data["use_gpu"]),
            device=data["device"],
            gpu_index=data["gpu_index"],
            gpu_uuid=data["gpu_uuid"],
            gpu_name=data["gpu_name"],
            memory_fraction=data["memory_fraction"],
            reason=str(data["reason"]),
            warnings=tuple(data["warnings"]),
        )


def find_device(devices: tuple[GpuRecord, ...], wanted: str) -> GpuRecord | None | str:
    """The device ``--gpu-index``-style ``wanted`` names: an NVML index (a whole GPU), a GPU
    or MIG UUID, or a unique prefix of one (as CUDA_VISIBLE_DEVICES accepts); None when it
    names none, or a note when it names a GPU in MIG mode, which cannot train whole."""
    if wanted.isdigit():
        whole = next((g for g in devices if g.mig is None and g.index == int(wanted)), None)
        if whole is not None:
            return whole
        migs = [g.uuid for g in devices if g.mig is not None and g.index == int(wanted)]
        if migs:
            return (f"GPU {wanted} is in MIG mode and cannot train whole: name one of its MIG "
                    f"devices ({', '.join(migs)})")
        return None
    exact = [g for g in devices if g.uuid.lower() == wanted.lower()]
    if exact:
        return exact[0]
    prefixed = [g for g in devices if g.uuid and g.uuid.lower().startswith(wanted.lower())]
    return prefixed[0] if len(prefixed) == 1 else None


def _none_usable(gpus: tuple[GpuRecord, ...], min_free_mib: int) -> str:
    if not gpus:
        return "NVML sees no GPU, nor a MIG device"
    healthy = [g for g in gpus if g.healthy]
    if not healthy:
        details = "; ".join(f"{label(g)}: {g.reason}" for g in gpus)
        return f"all {len(gpus)} GPUs are unhealthy ({details})"
    known = [g for g in healthy if g.memory_free_mib is not None]
    if not known:
        return (
            f"no GPU reports its free memory, so none can be shown to have "
            f"--gpu-min-free-mib {min_free_mib} MiB free"
        )
    best = max(known, key=lambda g: g.memory_free_mib or 0)
    return (
        f"all {len(healthy)} healthy GPUs have less than --gpu-min-free-mib {min_free_mib} MiB "
        f"free (most: {label(best)} {best.name!r} with {best.memory_free_mib} MiB)"
    )


def select_device(
    gpus: Iterable[GpuRecord], flags: GpuFlags
) -> tuple[GpuRecord | None, str, tuple[str, ...]]:
    """The device to train on (a GPU or a MIG device, from `training_devices`), the reason,
    and warnings (e.g. a requested index that failed).

    Best = most free memory among healthy devices with at least ``min_free_mib`` free; ties
    go to the lower index so the choice is stable between rounds.
    """
    gpus = tuple(gpus)
    warnings: list[str] = []
    if flags.index is not None:
        found = find_device(gpus, flags.index)
        wanted = found if isinstance(found, GpuRecord) else None
        problem = None
        if isinstance(found, str):
            problem = found
        elif wanted is None:
            seen = ", ".join(sorted({str(g.index) for g in gpus}, key=int)) or "none"
            problem = f"no such GPU or MIG device (NVML indices seen: {seen})"
        elif not wanted.healthy:
            problem = f"{label(wanted)} is unhealthy: {wanted.reason}"
        elif not has_room(wanted, flags.min_free_mib):
            problem = (
                f"{label(wanted)} has {wanted.memory_free_mib} MiB free, "
                f"below --gpu-min-free-mib {flags.min_free_mib}"
            )
        if wanted is not None and problem is None:
            return wanted, f"requested by --gpu-index {flags.index}", ()
        warnings.append(f"--gpu-index {flags.index}: {problem}; falling back to the best GPU")
    usable = [g for g in gpus if g.healthy and has_room(g, flags.min_free_mib)]
    if not usable:
        return None, _none_usable(gpus, flags.min_free_mib), tuple(warnings)
    best = min(usable, key=rank)
    what = "GPUs" if all(g.mig is None for g in gpus) else "devices"
    if len(usable) == 1:
        reason = f"only usable {what[:-1]} ({best.memory_free_mib} MiB free)"
    else:
        reason = f"most free memory ({best.memory_free_mib} MiB) of {len(usable)} usable {what}"
    if best.mig is not None:
        reason += f", {label(best)}"
    if len(usable) < len(gpus):
        reason += f", {len(gpus)} seen"
    if flags.min_free_mib:
        reason += f", --gpu-min-free-mib {flags.min_free_mib}"
    return best, reason, tuple(warnings)


def _cpu(flags: GpuFlags, reason: str, warnings: tuple[str, ...] = ()) -> Decision:
    return Decision(flags.mode, False, "cpu", None, None, None, None, reason, warnings)


def _gpu(flags: GpuFlags, g: GpuRecord, reason: str, warnings: tuple[str, ...]) -> Decision:
    return Decision(
        flags.mode, True, "cuda", g.index, g.uuid, g.name, flags.memory_fraction, reason, warnings
    )


def _enforce_failure(snapshot: NvmlSnapshot, why: str) -> EnforceError:
    if not snapshot.available:
        return EnforceError(
            f"started with --gpu enforce but NVML is unavailable: {snapshot.reason}"
        )
    if not snapshot.gpus:
        return EnforceError(
            f"started with --gpu enforce but NVML sees no GPU ({snapshot.reason}): {_NO_GPU_HINT}"
        )
    return EnforceError(f"started with --gpu enforce but no usable GPU: {why}")


def _select(
    snapshot: NvmlSnapshot, flags: GpuFlags
) -> tuple[GpuRecord | None, str, tuple[str, ...]]:
    devices = training_devices(snapshot.gpus)
    if snapshot.gpus and not devices:
        # Every GPU is in MIG mode without a MIG device: say so, not "no GPU".
        details = "; ".join(f"GPU {g.index}: {g.mig_reason}" for g in snapshot.gpus)
        return None, f"no device to train on ({details})", ()
    return select_device(devices, flags)


def decide(snapshot: NvmlSnapshot, flags: GpuFlags, job_use_gpu: bool) -> Decision:
    """Applies the node policy table; raises EnforceError for enforce without a usable GPU."""
    if flags.mode == "none":
        return _cpu(flags, "node started with --gpu none: GPUs hidden from training")
    if flags.mode == "offer" and not job_use_gpu:
        return _cpu(flags, "job does not ask for a GPU")
    chosen, why, warnings = (
        _select(snapshot, flags) if snapshot.available else (None, snapshot.reason, ())
    )
    if chosen is None:
        if flags.mode == "enforce":
            raise _enforce_failure(snapshot, why)
        if not snapshot.available:
            why = f"NVML unavailable: {why}"
        return _cpu(flags, f"no usable GPU, training on CPU: {why}", warnings)
    if flags.mode == "enforce" and not job_use_gpu:
        why = f"node enforces a GPU though the job does not ask for one; {why}"
    return _gpu(flags, chosen, why, warnings)


def capacity(snapshot: NvmlSnapshot, flags: GpuFlags) -> admission.SiteCapacity:
    """What admission reads of this node: its policy and its GPUs as the snapshot saw them."""
    return admission.SiteCapacity(
        mode=GpuMode(flags.mode),
        min_free_mib=flags.min_free_mib,
        nvml_available=snapshot.available,
        nvml_reason=snapshot.reason,
        gpus=tuple(admission.GpuFree(g.index, g.uuid, g.memory_free_mib, g.memory_total_mib,
                                     g.healthy) for g in training_devices(snapshot.gpus)),
    )


def decide_for_job(snapshot: NvmlSnapshot, flags: GpuFlags, need: Resources) -> Decision:
    """The device for one task of a job that needs `need`, from the GPUs as they are now.

    Raises Ineligible (with the reason the aggregator shows) when the job cannot run here: the
    rule is fedgpu.core.admission's, the one the aggregator samples by. Otherwise the site's
    policy table applies with the job's min_gpu_free_mib raising the site's minimum, and the
    job's gpu_memory_mib becomes a fraction of the chosen card.
    """
    site = capacity(snapshot, flags)
    why = admission.refusal(need, site)
    if why is not None:
        raise Ineligible(why)
    minimum = admission.minimum_free(need, site)
    effective = replace(flags, min_free_mib=minimum)
    decision = decide(snapshot, effective, job_use_gpu=need.gpu is not GpuNeed.NONE)
    if minimum > flags.min_free_mib:
        decision = replace(decision, reason=f"{decision.reason} (the job asks for "
                           f"min_gpu_free_mib {need.min_gpu_free_mib})")
    if decision.device != "cuda" or need.gpu_memory_mib is None:
        return decision
    total = next((g.memory_total_mib for g in training_devices(snapshot.gpus)
                  if g.uuid == decision.gpu_uuid), None)
    fraction = admission.memory_fraction(need, total, flags.memory_fraction)
    if total is None:
        warning = (f"the job caps GPU memory at {need.gpu_memory_mib} MiB but "
                   f"{decision.gpu_uuid}'s total memory is unknown: not capped by the job")
        return replace(decision, warnings=(*decision.warnings, warning))
    return replace(decision, memory_fraction=fraction,
                   reason=f"{decision.reason}; memory capped at {fraction} of {total} MiB "
                   f"(job gpu_memory_mib {need.gpu_memory_mib})")


def check_startup(snapshot: NvmlSnapshot, flags: GpuFlags) -> None:
    """At agent start: raises EnforceError when ``--gpu enforce`` cannot be met."""
    if flags.mode == "enforce":
        decide(snapshot, flags, job_use_gpu=True)


def subprocess_env(decision: Decision, base_env: Mapping[str, str]) -> dict[str, str]:
    """Environment for the round's training subprocess.

    The chosen GPU is passed by UUID: NVML indices and CUDA ordinals can differ, a UUID
    cannot, and inside the subprocess it is then always ``cuda:0``. A MIG device is passed
    by its ``MIG-`` UUID, which CUDA (11.1+) accepts in CUDA_VISIBLE_DEVICES the same way.
    """
    env = dict(base_env)
    env.pop("FEDGPU_MEMORY_FRACTION", None)
    if decision.device == "cpu":
        # Empty, not unset: unset would let CUDA see every GPU of the host.
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["FEDGPU_DEVICE"] = "cpu"
        return env
    if not decision.gpu_uuid:
        raise ValueError("a GPU decision without a GPU UUID cannot be handed to a subprocess")
    env["CUDA_VISIBLE_DEVICES"] = decision.gpu_uuid
    env["FEDGPU_DEVICE"] = "cuda:0"
    if decision.memory_fraction is not None:
        env["FEDGPU_MEMORY_FRACTION"] = repr(decision.memory_fraction)
    return env


def _logfmt(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if not text or any(c in text for c in ' "=\\') or not text.isprintable():
        return json.dumps(text)
    return text


def log_line(decision: Decision) -> str:
    """One logfmt line with the decision and its reason; absent values are left out."""
    fields: list[tuple[str, object]] = [
        ("mode", decision.mode),
        ("use_gpu", decision.use_gpu),
        ("device", decision.device),
        ("uuid", decision.gpu_uuid),
        ("index", decision.gpu_index),
        ("name", decision.gpu_name),
        ("memory_fraction", decision.memory_fraction),
        ("reason", decision.reason),
        ("warnings", "; ".join(decision.warnings) or None),
    ]
    parts = [f"{k}={_logfmt(v)}" for k, v in fields if v is not None]
    return "gpu-decision " + " ".join(parts)
