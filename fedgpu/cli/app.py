"""The `fedgpu` command: one small module per command group, registered here."""

from __future__ import annotations

import sys

import typer

from fedgpu.core import lifetime
from fedgpu.core.errors import FedgpuError

app = typer.Typer(
    name="fedgpu",
    help="Federated learning across GPU sites: local runs, nodes, aggregator, operations.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
DEBUG = {"on": False}


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors."),
) -> None:
    DEBUG["on"] = debug


def _register_all() -> None:
    from fedgpu.cli import (
        admin,
        certs_cmd,
        data,
        devices,
        job_cmd,
        node_cmd,
        run_cmd,
        server_cmd,
        sim_cmd,
        task_cmd,
    )

    for module in (run_cmd, devices, server_cmd, node_cmd, admin, job_cmd, data, sim_cmd,
                   certs_cmd, task_cmd):
        module.register(app)
    from fedgpu.cli import operator_cmds

    operator_cmds.register(app)


_register_all()


def main() -> None:
    # Started by another fedgpu process (`fedgpu run`)? Then end with it, even if it is
    # SIGKILLed. A no-op for commands a person or a container runtime starts.
    lifetime.bind_to_parent()
    try:
        # Without standalone mode click returns a typer.Exit's code instead of exiting.
        rc = app(standalone_mode=False)
        sys.exit(rc if isinstance(rc, int) else 0)
    except FedgpuError as exc:
        if DEBUG["on"]:
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # usage errors of the CLI parser, and anything unexpected
        # typer ships its own copy of click; its usage errors carry show() and an exit code.
        show, code = getattr(exc, "show", None), getattr(exc, "exit_code", None)
        if callable(show) and isinstance(code, int):
            show()
            sys.exit(code)
        if DEBUG["on"]:
            raise
        print(f"error: {type(exc).__name__}: {exc} (run with --debug for the traceback)",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
