"""`fedgpu ui`: the dashboard's URL, checked, and opened in a browser where there is a screen."""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
import webbrowser
from typing import Annotated

import typer

from fedgpu.cli.common.connect import Target, connection_options
from fedgpu.core.errors import FedgpuError

# What compose publishes and the docs suggest; the server's own default is off (0).
DEFAULT_UI_PORT = 8080


def dashboard_url(host: str, port: int) -> str:
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"  # listening everywhere: this machine reaches it on loopback
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}/"


def has_display() -> bool:
    """A browser can open a window: macOS and Windows always, elsewhere an X or Wayland
    display (not over plain SSH, where webbrowser would start a text browser in the terminal)."""
    if sys.platform in ("darwin", "win32"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def probe(url: str, timeout: float = 5.0) -> str | None:
    """None when the dashboard answers at `url`; else why not."""
    try:
        with urllib.request.urlopen(url + "login", timeout=timeout) as r:
            page = r.read(64 << 10)
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code} from {url}login"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"{reason}"
    if b"fedgpu" not in page:
        return "something else answers there, not a fedgpu dashboard"
    return None


def from_aggregator(conn: Target) -> tuple[str, int] | str:
    """The dashboard's (host, port) as the aggregator reports it, or why it could not be
    asked; FedgpuError when it answers that it serves none."""
    from fedgpu.core import admin_client
    from fedgpu.core.tls_diagnosis import split

    try:
        doc = admin_client.query(conn.address, conn.token, "GetStatus", tls=conn.tls,
                                 timeout=5)
    except FedgpuError as exc:
        return str(exc)
    dash = doc.get("dashboard")
    if not dash:
        raise FedgpuError(f"the aggregator at {conn.address} serves no dashboard: start it "
                          "with --ui-port PORT (and --operator-token)")
    host = str(dash["host"])
    if host in ("", "0.0.0.0", "::"):
        # Listening everywhere (a container): reach it where we reach the aggregator.
        host = split(conn.address)[0]
    return host, int(dash["port"])


@connection_options
def ui(
    conn: Target,
    host: Annotated[str | None, typer.Option(
        "--ui-host", envvar="FEDGPU_UI_HOST", show_default="as the aggregator reports",
        help="Where the dashboard listens.")] = None,
    port: Annotated[int | None, typer.Option(
        "--ui-port", envvar="FEDGPU_UI_PORT", min=1, max=65535,
        show_default="as the aggregator reports, else 8080",
        help="The aggregator's --ui-port (or the local end of an SSH tunnel).")] = None,
    open_browser: Annotated[bool, typer.Option(
        "--open/--no-open", help="Open it in a browser (only where there is a display).")
    ] = True,
) -> None:
    """Print the dashboard's URL, check that it answers, and open it in a browser. Without
    --ui-port, the aggregator (the connection's, as for `fedgpu status`) says where its
    dashboard is.

    Example: fedgpu ui --connection compose
    """
    if port is None:
        found = from_aggregator(conn)
        if isinstance(found, str):
            typer.echo(f"could not ask the aggregator for its dashboard ({found}); trying "
                       f"port {DEFAULT_UI_PORT}", err=True)
            port = DEFAULT_UI_PORT
        else:
            host = host or found[0]
            port = found[1]
    url = dashboard_url(host or "127.0.0.1", port)
    typer.echo(url)
    why = probe(url)
    if why is not None:
        raise FedgpuError(
            f"no dashboard answers at {url} ({why}): start the aggregator with --ui-port "
            f"{port}, or, for a remote aggregator, open a tunnel first: ssh -L "
            f"{port}:127.0.0.1:{port} HOST")
    typer.echo("log in with the operator token (the aggregator's --operator-token)", err=True)
    if open_browser and has_display():
        webbrowser.open(url)
