"""`fedgpu node factory`: one process per host that forks every round's worker."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer


def factory(
    socket_path: Annotated[Path, typer.Option(
        "--socket", help="Unix socket to serve; its directory must be yours and private "
                         "(chmod 700).")],
    cpu_slots: Annotated[int, typer.Option(
        min=0, help="CPU rounds training at once on this host (0: one per core).")] = 0,
    log_level: Annotated[str, typer.Option(help="Logging level.")] = "INFO",
) -> None:
    """Serve round workers to this host's node agents (`node start --worker-factory`).

    One process imports torch once and forks every round's worker from it; slots bound how many
    train at once.

    Example: fedgpu node factory --socket /run/fedgpu/factory.sock
    """
    # The CLI has imported gRPC and numpy (threads); the factory must fork from a
    # single-threaded process, so it replaces this one (same pid: lifetimes are unchanged).
    cmd = [sys.executable, "-m", "fedgpu.node.rounds.factory", "--socket", str(socket_path),
           "--cpu-slots", str(cpu_slots), "--log-level", log_level]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)
