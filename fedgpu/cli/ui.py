"""`fedgpu ui`: the dashboard's URL, checked, and opened in a browser where there is a screen."""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
import webbrowser
from typing import Annotated

import typer

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


def ui(
    host: Annotated[str, typer.Option(
        "--ui-host", envvar="FEDGPU_UI_HOST", help="Where the dashboard listens.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(
        "--ui-port", envvar="FEDGPU_UI_PORT", min=1, max=65535,
        help="The aggregator's --ui-port (or the local end of an SSH tunnel).")
    ] = DEFAULT_UI_PORT,
    open_browser: Annotated[bool, typer.Option(
        "--open/--no-open", help="Open it in a browser (only where there is a display).")
    ] = True,
) -> None:
    """Print the dashboard's URL, check that it answers, and open it in a browser.

    Example: fedgpu ui --ui-port 8080
    """
    url = dashboard_url(host, port)
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
