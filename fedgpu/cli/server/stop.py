"""`fedgpu server stop`: stop a running aggregator through its Admin service (operator)."""

from __future__ import annotations

from typing import Annotated

import typer

from fedgpu.cli.common.connect import Target, connection_options
from fedgpu.cli.common.options import AsJson
from fedgpu.cli.common.output import print_json
from fedgpu.core import admin_client


@connection_options
def stop(conn: Target,
         retire_nodes: Annotated[bool, typer.Option(
             "--retire-nodes", help="Also tell every node it is retired: each exits, and none "
             "is listed as lost at the next start. Without it a stop is a restart: nodes keep "
             "their registration and reconnect when the aggregator is back.")] = False,
         as_json: AsJson = False) -> None:
    """Stop the aggregator (as SIGTERM does). A running job stays running in the state
    directory and resumes when the aggregator starts again on it.

    Example: fedgpu server stop --retire-nodes
    """
    doc = admin_client.query(conn.address, conn.token, "StopServer", tls=conn.tls,
                             retire_nodes=retire_nodes)
    if as_json:
        print_json(doc)
    elif retire_nodes:
        typer.echo(f"aggregator at {conn.address} is stopping; every node is told it is "
                   "retired and exits")
    else:
        typer.echo(f"aggregator at {conn.address} is stopping; nodes keep their registration "
                   "and reconnect when it starts again")
