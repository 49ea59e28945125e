"""The --tls-* options every command that talks gRPC takes, with their environment fallbacks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

TlsCert = Annotated[Path | None, typer.Option(
    "--tls-cert", envvar="FEDGPU_TLS_CERT",
    help="This side's certificate (PEM): the aggregator's, or a node's/operator's client cert.")]
TlsKey = Annotated[Path | None, typer.Option(
    "--tls-key", envvar="FEDGPU_TLS_KEY", help="Private key (PEM) for --tls-cert.")]
TlsCa = Annotated[Path | None, typer.Option(
    "--tls-ca", envvar="FEDGPU_TLS_CA",
    help="CA certificate (PEM). Aggregator: require client certs it signed (mutual TLS). "
         "Node/CLI: trust the aggregator's cert.")]
