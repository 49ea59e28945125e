"""``fedgpu devices``: this host's NVML view and what the node GPU policy would decide."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from fedgpu.core.errors import ConfigError, FedgpuError

if TYPE_CHECKING:
    # Imported in the command itself: registering it must not load the NVML layer into
    # every `fedgpu` process (the aggregator image runs `fedgpu server start`).
    from fedgpu.node import nvml
    from fedgpu.node.policy import Decision


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value:,}"


def _row(g: nvml.GpuRecord) -> list[str]:
    health = g.reason if g.healthy else f"[red]{g.reason}[/]"
    if g.mig_mode:
        # The GPU itself is not a device to train on: its MIG devices, listed under it, are.
        health += f"; [cyan]{g.mig_reason}[/]"
    elif g.mig_mode is False and "next GPU reset" in g.mig_reason:
        health += f"; {g.mig_reason}"
    idx = str(g.index) if g.mig is None else f"  └ {g.index}:{g.mig.mig_index}"
    return [
        idx,
        g.uuid or "?",
        g.name or "?",
        _mib(g.memory_free_mib),
        _mib(g.memory_used_mib),
        _mib(g.memory_total_mib),
        _mib(g.utilization_pct),
        g.compute_capability or "n/a",
        str(len(g.processes)),
        health,
    ]


def _render(snap: nvml.NvmlSnapshot, decision: Decision | None) -> None:
    out = Console()
    if snap.available:
        out.print(
            f"NVML: driver {snap.driver_version or 'unknown'}, "
            f"CUDA {snap.cuda_driver_version or 'unknown'}; {snap.reason}"
        )
    else:
        out.print(f"[bold yellow]NVML unavailable:[/] {snap.reason}", highlight=False)
    if snap.gpus:
        table = Table(
            "idx",
            "uuid",
            "name",
            "free MiB",
            "used MiB",
            "total MiB",
            "util %",
            "cc",
            "procs",
            "health",
        )
        for g in snap.gpus:
            table.add_row(*_row(g))
            for mig in g.mig_devices:
                table.add_row(*_row(mig))
        out.print(table)
    if decision is not None:
        what = "MIG device" if (decision.gpu_uuid or "").startswith("MIG-") else "GPU"
        on = f" of GPU {decision.gpu_index}" if what == "MIG device" else f" {decision.gpu_index}"
        target = (
            f"{what}{on} {decision.gpu_uuid} ({decision.gpu_name})" if decision.use_gpu else "CPU"
        )
        out.print(f"Decision (--gpu {decision.mode}): train on {target}", highlight=False)
        out.print(f"  reason: {decision.reason}", highlight=False)
        for warning in decision.warnings:
            out.print(f"  [yellow]warning:[/] {warning}", highlight=False)


def devices(
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print one JSON document (schema: "
                     "docs/reference/devices-json.md)."),
    ] = False,
    gpu: Annotated[
        str,
        typer.Option("--gpu", help="Node GPU mode to evaluate: none, offer or enforce."),
    ] = "offer",
    gpu_index: Annotated[
        str | None,
        typer.Option("--gpu-index", help="Preferred device: NVML index, GPU UUID (GPU-...) "
                     "or MIG device UUID (MIG-...)."),
    ] = None,
    gpu_min_free_mib: Annotated[
        int,
        typer.Option("--gpu-min-free-mib", help="A GPU needs at least this much free memory."),
    ] = 0,
    gpu_memory_fraction: Annotated[
        float | None,
        typer.Option("--gpu-memory-fraction", help="Cap for the training process, in (0, 1]."),
    ] = None,
    use_gpu: Annotated[
        bool,
        typer.Option("--use-gpu/--no-use-gpu", help="Whether the job asks for a GPU."),
    ] = True,
) -> None:
    """Show this host's GPUs as NVML sees them and which device the node policy picks.

    A GPU in MIG mode is listed with its MIG devices under it; those, not the GPU, are what
    the policy picks from.

    Example: fedgpu devices --gpu offer --json
    """
    from fedgpu.node import nvml
    from fedgpu.node.policy import EnforceError, PolicyError, decide, parse_gpu_flags

    try:
        flags = parse_gpu_flags(gpu, gpu_index, gpu_min_free_mib, gpu_memory_fraction)
    except PolicyError as err:
        raise ConfigError(str(err)) from None
    snap = nvml.snapshot()
    decision: Decision | None = None
    error: str | None = None
    try:
        decision = decide(snap, flags, job_use_gpu=use_gpu)
    except EnforceError as err:
        error = str(err)
    if as_json:
        doc: dict[str, Any] = {
            "nvml": nvml.to_dict(snap),
            "decision": None if decision is None else decision.to_dict(),
            "error": error,
        }
        typer.echo(json.dumps(doc, indent=2))
    else:
        _render(snap, decision)
    if error is not None:
        # The app prints it as one line on stderr and exits 1, after the JSON or table.
        raise FedgpuError(error)
