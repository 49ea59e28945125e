"""Choosing several devices for one round (data-parallel workers): a pure function of the
device records, the site's GPU policy and what the job asks for.

The round machinery calls `choose_devices` at admission, with the live snapshot's
`training_devices` (whole GPUs, MIG devices in place of a GPU in MIG mode): it gets the
devices to start one worker on each (in rank order, best first), or the refusal to send the
aggregator as the "ineligible" reason. One device is the special case: `choose_devices` with
``workers=1`` picks what `policy.decide` picks.

Rules, for ``workers`` = N (or "all": every usable device) and the site's mode:

- ``none``, or ``offer`` when the job does not ask for a GPU: no GPU; the workers use the CPU.
- ``offer``: the N usable devices with most free memory; with fewer, as many as there are
  if the job accepts that many (``min_workers``), else a refusal; with none at all, the CPU
  (as for one device: offer never refuses a job for lack of any GPU).
- ``enforce``: exactly N usable devices, else a refusal (N = "all": at least one).

A device is usable when it is healthy, has max(site --gpu-min-free-mib, job minimum) MiB free,
and (with a site allow-list) is on the list. ``--gpu-index`` ranks its device first when that
device is usable; the others follow by free memory, ties to the lower index.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from fedgpu.node.gpu_records import GpuRecord, has_room, label, rank
from fedgpu.node.policy import GpuFlags, find_device

# Devices listed by name in a reason; more are summarised.
_SHOWN = 8
# No host has more; a larger request is a typo, refused as such.
MAX_WORKERS = 1024


@dataclass(frozen=True)
class DeviceRequest:
    """What a job asks of a site: ``workers`` devices (or "all"), accepting as few as
    ``min_workers`` under ``offer`` (None: exactly ``workers``), each with at least
    ``min_free_mib`` free (the job's own minimum, on top of the site's)."""

    workers: int | Literal["all"] = 1
    min_workers: int | None = None
    min_free_mib: int = 0

    def __post_init__(self) -> None:
        # bool is an int in Python; `workers = true` in a job file is a mistake, not 1.
        if self.workers != "all" and (
            isinstance(self.workers, bool) or not isinstance(self.workers, int)
            or not 1 <= self.workers <= MAX_WORKERS
        ):
            raise ValueError(f"workers must be 1..{MAX_WORKERS} or \"all\", not {self.workers!r}")
        if self.min_workers is not None:
            top = MAX_WORKERS if self.workers == "all" else self.workers
            if not (isinstance(self.min_workers, int) and 1 <= self.min_workers <= top):
                raise ValueError(f"min_workers must be 1..{top} (workers), "
                                 f"not {self.min_workers!r}")
        if self.min_free_mib < 0:
            raise ValueError(f"min_free_mib must be >= 0, not {self.min_free_mib}")


@dataclass(frozen=True)
class DeviceChoice:
    """The devices to train on (best first; empty: the CPU), why, and a refusal when the site
    cannot take the job (then ``devices`` is empty)."""

    devices: tuple[GpuRecord, ...]
    reason: str
    refusal: str | None = None
    warnings: tuple[str, ...] = ()

    @property
    def granted(self) -> bool:
        return self.refusal is None

    @property
    def uuids(self) -> tuple[str, ...]:
        """For the workers' CUDA_VISIBLE_DEVICES (one each) and the memory sampler."""
        return tuple(d.uuid for d in self.devices)


def _allowed(device: GpuRecord, allowed: Sequence[str]) -> bool:
    # A GPU's UUID on the list allows its MIG devices too: a site lists the cards it gives.
    names = {device.uuid.lower()}
    if device.mig is not None:
        names.add(device.mig.parent_uuid.lower())
    return any(a.lower() in names for a in allowed)


def _why_not(device: GpuRecord, minimum: int) -> str:
    if not device.healthy:
        return f"{label(device)} is unhealthy ({device.reason})"
    if device.memory_free_mib is None:
        return f"{label(device)} does not report its free memory, needs {minimum}"
    return f"{label(device)} has {device.memory_free_mib} MiB free, needs {minimum}"


def _shortfall(
    devices: tuple[GpuRecord, ...], usable: list[GpuRecord], minimum: int, excluded: int,
    wanted: int,
) -> str:
    unusable = [d for d in devices if d not in usable]
    parts = []
    if 0 < len(devices) < wanted:
        parts.append(f"it has {len(devices)} device{'s' if len(devices) != 1 else ''}")
    parts.extend(_why_not(d, minimum) for d in unusable[:_SHOWN])
    if len(unusable) > _SHOWN:
        parts.append(f"{len(unusable) - _SHOWN} more")
    if excluded:
        parts.append(f"{excluded} not on the site's allowed list")
    if not devices and not excluded:
        parts.append("NVML sees no GPU, nor a MIG device")
    return "; ".join(parts)


def _ordered(
    usable: list[GpuRecord], flags: GpuFlags, candidates: tuple[GpuRecord, ...]
) -> tuple[list[GpuRecord], list[str]]:
    ordered = sorted(usable, key=rank)
    if flags.index is None:
        return ordered, []
    found = find_device(candidates, flags.index)
    if isinstance(found, GpuRecord) and found in ordered:
        ordered.remove(found)
        return [found, *ordered], []
    why = found if isinstance(found, str) else (
        "not usable" if isinstance(found, GpuRecord) else "no such GPU or MIG device")
    return ordered, [f"--gpu-index {flags.index}: {why}; ranked by free memory instead"]


def choose_devices(
    devices: Iterable[GpuRecord],
    flags: GpuFlags,
    request: DeviceRequest,
    job_use_gpu: bool = True,
    allowed: Sequence[str] | None = None,
) -> DeviceChoice:
    """The devices for one round of a job asking for ``request``; see the module's rules.

    ``devices`` are `gpu_records.training_devices` of a live snapshot; ``allowed`` is the
    site's list of GPU/MIG UUIDs it gives to training (None: all).
    """
    every = tuple(devices)
    if flags.mode == "none":
        return DeviceChoice((), "node started with --gpu none: GPUs hidden from training")
    if flags.mode == "offer" and not job_use_gpu:
        return DeviceChoice((), "job does not ask for a GPU")
    candidates = every if allowed is None else tuple(d for d in every if _allowed(d, allowed))
    minimum = max(flags.min_free_mib, request.min_free_mib)
    usable = [d for d in candidates if d.healthy and has_room(d, minimum)]
    ordered, warnings = _ordered(usable, flags, candidates)
    wanted = len(ordered) if request.workers == "all" else request.workers
    asked = "all the GPUs" if request.workers == "all" else (
        f"the {wanted} GPU{'s' if wanted != 1 else ''}")
    shortfall = _shortfall(candidates, usable, minimum, len(every) - len(candidates), wanted)
    if ordered and len(ordered) >= wanted:
        chosen = tuple(ordered[:wanted])
        reason = (f"{len(chosen)} of {len(candidates)} device{'s' if len(candidates) != 1 else ''}"
                  f" by free memory: " + ", ".join(
                      f"{label(d)} {d.memory_free_mib} MiB" for d in chosen[:_SHOWN]))
        if request.workers == "all" and len(ordered) < len(candidates):
            reason += f" ({shortfall})"
        return DeviceChoice(chosen, reason, None, tuple(warnings))
    if not ordered and flags.mode == "offer":
        return DeviceChoice((), f"no usable GPU, training on CPU: {shortfall}", None,
                            tuple(warnings))
    fewest = request.min_workers if flags.mode == "offer" else None
    if ordered and fewest is not None and len(ordered) >= fewest:
        chosen = tuple(ordered)
        reason = (f"{len(chosen)} of the {wanted} GPUs the job asks for (it accepts "
                  f"{fewest}): {shortfall}")
        return DeviceChoice(chosen, reason, None, tuple(warnings))
    refusal = f"this site can give {len(ordered)} of {asked} the job asks for: {shortfall}"
    if fewest is not None:
        refusal += f" (the job accepts no fewer than {fewest})"
    elif flags.mode == "enforce" and request.min_workers is not None:
        refusal += " (fewer devices are given only with --gpu offer)"
    return DeviceChoice((), "", refusal, tuple(warnings))
