"""Options shared by many commands, each defined once: the TLS files, the aggregator's
address and the operator token (with their environment fallbacks), --json, and the
--connection that picks a saved connection (fedgpu.cli.common.connect puts the set together)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

# Rich markup is on in help texts: a literal "[" must be written "\[" (or avoided).
TlsCert = Annotated[Path | None, typer.Option(
    "--tls-cert", envvar="FEDGPU_TLS_CERT",
    help="This side's certificate (PEM): the aggregator's, or a node's/operator's client cert.")]
TlsKey = Annotated[Path | None, typer.Option(
    "--tls-key", envvar="FEDGPU_TLS_KEY", help="Private key (PEM) for --tls-cert.")]
TlsCa = Annotated[Path | None, typer.Option(
    "--tls-ca", envvar="FEDGPU_TLS_CA",
    help="CA certificate (PEM). Aggregator: require client certs it signed (mutual TLS). "
         "Node/CLI: trust the aggregator's cert.")]

DEFAULT_ADDRESS = "localhost:50051"
# None, not DEFAULT_ADDRESS: a command must know whether an address was given at all, to
# fall back to the saved connection only when none was.
Address = Annotated[str | None, typer.Option(
    "--address", envvar="FEDGPU_AGGREGATOR",
    help=f"Aggregator HOST:PORT (default: the saved connection's, else {DEFAULT_ADDRESS}).")]
# Operators hold a credential nodes don't have: the aggregator's --operator-token (or an
# operator certificate under mutual TLS, made by 'fedgpu certs operator').
OperatorToken = Annotated[str | None, typer.Option(
    "--token", envvar="FEDGPU_OPERATOR_TOKEN",
    help="The aggregator's operator token (its --operator-token), not the nodes' token.")]
ConnectionName = Annotated[str | None, typer.Option(
    "--connection", "-c", envvar="FEDGPU_CONNECTION",
    help="A saved connection ('fedgpu connection list'); default: the default one, unless "
         "an address is given.")]
Insecure = Annotated[bool, typer.Option(
    "--insecure", help="Plain gRPC without TLS, whatever the saved connection or the "
                       "FEDGPU_TLS_* variables say.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print one JSON document, nothing else.")]

# Seconds between polls: `status --watch`'s default, and `job submit --watch`'s.
WATCH_INTERVAL_S = 2.0
