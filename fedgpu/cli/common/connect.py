"""How a command that talks to an aggregator finds it: one set of connection options
(--connection, --address, --token, --tls-ca/--tls-cert/--tls-key, --insecure) added to each
such command by `@connection_options`, resolved against the saved connections into a Target.

Each setting comes from the first of:

1. the option on the command line;
2. the saved connection: the one --connection (or FEDGPU_CONNECTION) names, else the default
   one, but the default only when no address is given (--address or FEDGPU_AGGREGATOR): its
   credentials belong to its own address;
3. the option's environment variable (FEDGPU_AGGREGATOR, FEDGPU_OPERATOR_TOKEN,
   FEDGPU_TLS_*); a saved connection's TLS files replace the FEDGPU_TLS_* set as a whole;
4. the built-in default: localhost:50051, plain gRPC, no token.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import typer

from fedgpu.cli.common import connections
from fedgpu.cli.common.options import (
    DEFAULT_ADDRESS,
    Address,
    ConnectionName,
    Insecure,
    OperatorToken,
    TlsCa,
    TlsCert,
    TlsKey,
)
from fedgpu.core.errors import ConfigError, FedgpuError
from fedgpu.core.tls import TlsFiles, from_options


class Origin(StrEnum):
    """How a command's aggregator was chosen."""

    COMMAND_LINE = "command-line"  # --address or --connection
    ENVIRONMENT = "environment"  # FEDGPU_AGGREGATOR or FEDGPU_CONNECTION
    DEFAULT_CONNECTION = "default-connection"
    BUILT_IN = "built-in"  # localhost:50051


@dataclass(frozen=True)
class Target:
    """An aggregator as a command reaches it."""

    address: str
    token: str | None = None
    tls: TlsFiles | None = None
    # The saved connection it came from, if any (for messages).
    connection: str | None = None
    origin: Origin = Origin.COMMAND_LINE


@dataclass(frozen=True)
class Given:
    """The connection options as parsed, and where each came from (typer's parameter
    source: COMMANDLINE, ENVIRONMENT, DEFAULT)."""

    connection: str | None = None
    address: str | None = None
    token: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    insecure: bool = False
    on_command_line: frozenset[str] = frozenset()


_TLS = ("tls_cert", "tls_key", "tls_ca")


def resolve(given: Given, saved_file: Path | None = None) -> Target:
    """The Target the rules in this module's docstring give."""
    cli = given.on_command_line
    saved = None
    named = "connection" if given.connection else "address"
    origin = Origin.COMMAND_LINE if named in cli else Origin.ENVIRONMENT
    if given.connection:
        saved = connections.load(saved_file).get(
            connections.check_name(given.connection), saved_file or connections.file_path())
    elif given.address is None:
        conns = connections.load(saved_file)
        if conns.default is not None:
            saved = conns.saved[conns.default]
            origin = Origin.DEFAULT_CONNECTION
        else:
            origin = Origin.BUILT_IN

    address = given.address if "address" in cli or saved is None else saved.address
    token = given.token
    if saved is not None and saved.token_file is not None and "token" not in cli:
        token = connections.read_token(saved.token_file)

    if given.insecure and any(k in cli for k in _TLS):
        raise ConfigError("--insecure and --tls-ca/--tls-cert/--tls-key contradict each other")
    if given.insecure or (saved is not None and saved.insecure
                          and not any(k in cli for k in _TLS)):
        tls = None
    else:
        files = {k: getattr(given, k) for k in _TLS}
        if saved is not None:
            # The saved set replaces the environment's as a whole; the command line still
            # overrides one file at a time.
            files = {k: getattr(given, k) if k in cli else getattr(saved, k) for k in _TLS}
        tls = from_options(files["tls_cert"], files["tls_key"], files["tls_ca"])
    return Target(address or DEFAULT_ADDRESS, token or None, tls,
                  saved.name if saved is not None else None, origin)


def given_from(ctx: typer.Context | None, params: Mapping[str, str] | None = None,
               **values: Any) -> Given:
    """`values` by Given's field names; `params` maps a field to the command's parameter
    where it differs (doctor's operator token is its `operator_token`)."""
    on_cli = set()
    for name in values:
        param = (params or {}).get(name, name)
        source = ctx.get_parameter_source(param) if ctx is not None else None
        if source is not None and source.name == "COMMANDLINE":
            on_cli.add(name)
    return Given(**values, on_command_line=frozenset(on_cli))


# The options every aggregator-facing command gets, in the order help lists them.
_OPTIONS = [
    inspect.Parameter("connection", inspect.Parameter.KEYWORD_ONLY, default=None,
                      annotation=ConnectionName),
    inspect.Parameter("address", inspect.Parameter.KEYWORD_ONLY, default=None,
                      annotation=Address),
    inspect.Parameter("token", inspect.Parameter.KEYWORD_ONLY, default=None,
                      annotation=OperatorToken),
    inspect.Parameter("tls_ca", inspect.Parameter.KEYWORD_ONLY, default=None,
                      annotation=TlsCa),
    inspect.Parameter("tls_cert", inspect.Parameter.KEYWORD_ONLY, default=None,
                      annotation=TlsCert),
    inspect.Parameter("tls_key", inspect.Parameter.KEYWORD_ONLY, default=None,
                      annotation=TlsKey),
    inspect.Parameter("insecure", inspect.Parameter.KEYWORD_ONLY, default=False,
                      annotation=Insecure),
]
OPTION_NAMES = tuple(p.name for p in _OPTIONS)
_CTX = "connection_ctx"

F = TypeVar("F", bound=Callable[..., Any])


def connection_options(fn: F) -> F:
    """Give the command `fn` the shared connection options; it receives the resolved
    Target as its `conn` argument. The options are the same objects for every command, so
    they cannot drift apart (a test walks the tree to check each such command has them)."""
    sig = inspect.signature(fn, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "conn"]
    if len(own) == len(sig.parameters) or any(p.name in OPTION_NAMES for p in own):
        raise TypeError(f"{fn.__name__}: take `conn` and none of {', '.join(OPTION_NAMES)}")
    ctx_param = inspect.Parameter(_CTX, inspect.Parameter.KEYWORD_ONLY,
                                  annotation=typer.Context)
    # typer calls commands with keyword arguments only, so all may be keyword-only.
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]

    @functools.wraps(fn)
    def command(**kwargs: Any) -> Any:
        ctx = kwargs.pop(_CTX, None)
        values = {name: kwargs.pop(name) for name in OPTION_NAMES}
        if ctx is not None and getattr(ctx, "invoked_subcommand", None):
            # A group's own command (`fedgpu nodes`) called on the way to a subcommand
            # (`fedgpu nodes forget`): that one does the work, with its own options.
            return None
        conn = resolve(given_from(ctx, **values))
        try:
            return fn(conn=conn, **kwargs)
        except FedgpuError as exc:
            if conn.connection is None:
                raise
            # Say where the address and credentials came from: a default connection saved
            # by `make up` weeks ago is easy to forget.
            err = FedgpuError(f"{exc} [saved connection {conn.connection!r}: 'fedgpu "
                              "connection show' tells what was used]")
            err.exit_code = exc.exit_code
            raise err from None

    command.__signature__ = sig.replace(  # type: ignore[attr-defined]
        parameters=[ctx_param, *params, *_OPTIONS])
    return command  # type: ignore[return-value]
