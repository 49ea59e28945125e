"""Options shared by the commands that ask a running aggregator: its address, the operator
token, --json, and the --tls-* options, each with its environment fallback."""

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

Address = Annotated[str, typer.Option(
    "--address", envvar="FEDGPU_AGGREGATOR", help="Aggregator HOST:PORT.")]
# Operators hold a credential nodes don't have: the aggregator's --operator-token (or an
# operator certificate under mutual TLS, made by 'fedgpu certs operator').
OperatorToken = Annotated[str | None, typer.Option(
    "--token", envvar="FEDGPU_OPERATOR_TOKEN",
    help="The aggregator's operator token (its --operator-token), not the nodes' token.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print one JSON document, nothing else.")]
