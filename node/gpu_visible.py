"""Which GPUs `CUDA_VISIBLE_DEVICES` leaves this node, read the way CUDA reads it.

NVML numbers GPUs by PCI bus; the variable may hold indices, UUIDs, UUID prefixes or MIG names.
Pure functions of the records, so they are tested without any NVML.
"""

from __future__ import annotations

from collections.abc import Iterable

from fedgpu.node.gpu_records import GpuRecord


def _match_entry(gpus: Iterable[GpuRecord], entry: str) -> GpuRecord | None | str:
    """The GPU an entry names, None when it names none, or a note why it is not usable."""
    if entry.isdigit():
        return next((g for g in gpus if g.index == int(entry)), None)
    if entry.upper().startswith("MIG-"):
        return f"MIG device {entry} ignored: fedgpu selects whole GPUs only"
    wanted = entry.lower()
    if not wanted.startswith("gpu-"):
        wanted = "gpu-" + wanted
    hits = [g for g in gpus if g.uuid and g.uuid.lower().startswith(wanted)]
    if len(hits) > 1:
        return f"{entry} is an ambiguous UUID prefix ({len(hits)} GPUs match)"
    return hits[0] if hits else None


def resolve_visible(
    gpus: tuple[GpuRecord, ...], env_value: str | None, device_order: str | None = None
) -> tuple[tuple[GpuRecord, ...], tuple[str, ...]]:
    if env_value is None:
        return gpus, ()
    kept: list[GpuRecord] = []
    notes: list[str] = []
    for raw in env_value.split(","):
        entry = raw.strip()
        if not entry:
            continue
        match = _match_entry(gpus, entry)
        if isinstance(match, str):
            notes.append(match)
            continue
        if match is None:
            # CUDA stops at the first entry it cannot resolve and ignores the rest;
            # doing the same keeps our view equal to what a CUDA process would see.
            notes.append(
                f"CUDA_VISIBLE_DEVICES entry {entry!r} matches no GPU; later entries ignored"
            )
            break
        if match not in kept:
            kept.append(match)
    if any(e.strip().isdigit() for e in env_value.split(",")):
        if device_order != "PCI_BUS_ID" and len({g.name for g in gpus}) > 1:
            notes.append(
                "CUDA_VISIBLE_DEVICES uses indices, read as NVML indices; CUDA numbers mixed "
                "GPU models fastest-first unless CUDA_DEVICE_ORDER=PCI_BUS_ID: prefer UUIDs"
            )
    return tuple(kept), tuple(notes)


def visible_filter(gpus: Iterable[GpuRecord], env_value: str | None) -> tuple[GpuRecord, ...]:
    """The GPUs that ``CUDA_VISIBLE_DEVICES=env_value`` lets this node use (None: all).

    Entries may be NVML indices, full UUIDs or UUID prefixes; MIG entries are skipped.
    """
    return resolve_visible(tuple(gpus), env_value)[0]


def visible_notes(
    gpus: Iterable[GpuRecord], env_value: str | None, device_order: str | None = None
) -> tuple[str, ...]:
    """Why entries of ``CUDA_VISIBLE_DEVICES`` were ignored or may mislead; empty if none."""
    return resolve_visible(tuple(gpus), env_value, device_order)[1]
