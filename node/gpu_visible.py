"""Which GPUs `CUDA_VISIBLE_DEVICES` leaves this node, read the way CUDA reads it.

NVML numbers GPUs by PCI bus; the variable may hold indices, UUIDs, UUID prefixes or MIG
names: a MIG device's own UUID (`MIG-<uuid>`, R470+ drivers) or CUDA 11.0's
`MIG-GPU-<gpu uuid>/<gpu instance>/<compute instance>`. A MIG entry leaves its GPU with that
MIG device only; the round's worker is then given the MIG UUID (node/policy.py
`subprocess_env`), the one name that cannot be renumbered.
Pure functions of the records, so they are tested without any NVML.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from fedgpu.node.gpu_records import GpuRecord


def _match_mig(gpus: Iterable[GpuRecord], entry: str) -> GpuRecord | None | str:
    """The MIG device an entry names (None: none), or a note when it is ambiguous."""
    devices = [m for g in gpus if g.mig_mode for m in g.mig_devices]
    wanted = entry.lower()
    if wanted.startswith("mig-gpu-") and wanted.count("/") == 2:
        parent, gi, ci = wanted[len("mig-"):].split("/")
        return next((m for m in devices if m.mig is not None
                     and m.mig.parent_uuid.lower() == parent
                     and str(m.mig.gpu_instance_id) == gi
                     and str(m.mig.compute_instance_id) == ci), None)
    hits = [m for m in devices if m.uuid.lower().startswith(wanted)]
    if len(hits) > 1:
        return f"{entry} is an ambiguous MIG UUID prefix ({len(hits)} MIG devices match)"
    return hits[0] if hits else None


def _match_entry(gpus: Iterable[GpuRecord], entry: str) -> GpuRecord | None | str:
    """The GPU or MIG device an entry names, None when it names none, or a note why it is not
    usable."""
    if entry.isdigit():
        return next((g for g in gpus if g.index == int(entry)), None)
    if entry.upper().startswith("MIG-"):
        return _match_mig(gpus, entry)
    wanted = entry.lower()
    if not wanted.startswith("gpu-"):
        wanted = "gpu-" + wanted
    hits = [g for g in gpus if g.uuid and g.uuid.lower().startswith(wanted)]
    if len(hits) > 1:
        return f"{entry} is an ambiguous UUID prefix ({len(hits)} GPUs match)"
    return hits[0] if hits else None


def _narrowed(gpu: GpuRecord, migs: list[GpuRecord] | None) -> GpuRecord:
    return gpu if migs is None else replace(gpu, mig_devices=tuple(migs))


def resolve_visible(
    gpus: tuple[GpuRecord, ...], env_value: str | None, device_order: str | None = None
) -> tuple[tuple[GpuRecord, ...], tuple[str, ...]]:
    if env_value is None:
        return gpus, ()
    kept: list[GpuRecord] = []
    # Per kept GPU (by NVML index): the MIG devices named, or None when it was named whole.
    named_migs: dict[int, list[GpuRecord] | None] = {}
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
        parent = match
        if match.mig is not None:
            parent = next(g for g in gpus if g.index == match.index)
        if parent not in kept:
            kept.append(parent)
            named_migs[parent.index] = [] if match.mig is not None else None
        migs = named_migs[parent.index]
        if match.mig is None:
            named_migs[parent.index] = None  # named whole: all of its MIG devices
        elif migs is not None and match not in migs:
            migs.append(match)
    if any(e.strip().isdigit() for e in env_value.split(",")):
        if device_order != "PCI_BUS_ID" and len({g.name for g in gpus}) > 1:
            notes.append(
                "CUDA_VISIBLE_DEVICES uses indices, read as NVML indices; CUDA numbers mixed "
                "GPU models fastest-first unless CUDA_DEVICE_ORDER=PCI_BUS_ID: prefer UUIDs"
            )
    return tuple(_narrowed(g, named_migs[g.index]) for g in kept), tuple(notes)


def visible_filter(gpus: Iterable[GpuRecord], env_value: str | None) -> tuple[GpuRecord, ...]:
    """The GPUs that ``CUDA_VISIBLE_DEVICES=env_value`` lets this node use (None: all).

    Entries may be NVML indices, full UUIDs or UUID prefixes, or MIG UUIDs (the GPU is then
    kept with the named MIG devices only).
    """
    return resolve_visible(tuple(gpus), env_value)[0]


def visible_notes(
    gpus: Iterable[GpuRecord], env_value: str | None, device_order: str | None = None
) -> tuple[str, ...]:
    """Why entries of ``CUDA_VISIBLE_DEVICES`` were ignored or may mislead; empty if none."""
    return resolve_visible(tuple(gpus), env_value, device_order)[1]
