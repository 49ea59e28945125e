"""`fedgpu health`: the aggregator's standard gRPC health service, as a prober sees it."""

from __future__ import annotations

from typing import Annotated

import typer

from fedgpu.cli.common.connect import Target, connection_options
from fedgpu.core import admin_client


@connection_options
def health(conn: Target,
           service: Annotated[str, typer.Option(help="Service name; empty = server.")] = ""
           ) -> None:
    """Exit 0 when the aggregator's gRPC health service answers SERVING.

    Example: fedgpu health --address 127.0.0.1:50051
    """
    state = admin_client.health(conn.address, service, tls=conn.tls)
    typer.echo(state)
    raise typer.Exit(0 if state == "SERVING" else 1)
