"""The `fedgpu` command: the whole command tree, registered here and nowhere else.

`fedgpu X` lives in `fedgpu/cli/X` (a module, or a package with one module per command of a
group: `fedgpu job stop` is fedgpu/cli/job/stop.py); what commands share and is no command
lives in fedgpu/cli/common/. Command modules import typer, rich and fedgpu.core at most: the
node and server layers, torch, docker and matplotlib are imported inside the commands that
need them, so `fedgpu --help` and the aggregator's image stay light.
"""

from __future__ import annotations

import sys
from importlib import metadata
from typing import Annotated

import typer

from fedgpu.cli import (
    audit,
    certs,
    certs_request,
    connection,
    devices,
    health,
    nodes,
    rounds,
    sim,
    status,
    studies,
    ui,
    users,
)
from fedgpu.cli.common.help_format import show_flags_as_flags
from fedgpu.cli.data import partitions as data
from fedgpu.cli.data import synth_lm
from fedgpu.cli.deploy import down, logs, ps, up
from fedgpu.cli.doctor import doctor
from fedgpu.cli.job import list as job_list
from fedgpu.cli.job import logs as job_logs
from fedgpu.cli.job import model as job_model
from fedgpu.cli.job import status as job_status
from fedgpu.cli.job import stop as job_stop
from fedgpu.cli.job import submit as job_submit
from fedgpu.cli.kit import commands as kit_commands
from fedgpu.cli.node import approve as node_approve
from fedgpu.cli.node import factory as node_factory
from fedgpu.cli.node import health as node_health
from fedgpu.cli.node import start as node_start
from fedgpu.cli.node import start_many as node_start_many
from fedgpu.cli.node import tasks as node_tasks
from fedgpu.cli.report import report
from fedgpu.cli.run import run
from fedgpu.cli.server import start as server_start
from fedgpu.cli.server import stop as server_stop
from fedgpu.cli.task import check as task_check
from fedgpu.cli.task import new as task_new
from fedgpu.core import lifetime
from fedgpu.core.errors import FedgpuError

show_flags_as_flags()

# The help panels, in the order `fedgpu --help` shows them.
LOCAL = "Run locally"
DEPLOY = "Deploy"
OPERATE = "Operate a federation"
SITES = "Sites"
TASKS = "Tasks and data"
DIAGNOSE = "Diagnostics"

app = typer.Typer(
    name="fedgpu",
    help="Federated learning across GPU sites: local runs, nodes, aggregator, operations.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="markdown",
)
DEBUG = {"on": False}


def _version(value: bool) -> None:
    if value:
        try:
            version = metadata.version("fedgpu")
        except metadata.PackageNotFoundError:  # run from a checkout that was never installed
            from fedgpu import __version__ as version
        typer.echo(f"fedgpu {version}")
        raise typer.Exit(0)


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    DEBUG["on"] = debug


def _group(name: str, help: str, panel: str) -> typer.Typer:
    group = typer.Typer(help=help, no_args_is_help=True)
    app.add_typer(group, name=name, rich_help_panel=panel)
    return group


# ---- Run locally ---------------------------------------------------------------------------
app.command("run", rich_help_panel=LOCAL)(run.run)
app.command("sim", rich_help_panel=LOCAL)(sim.sim)
app.command("report", rich_help_panel=LOCAL)(report.report)

# ---- Deploy --------------------------------------------------------------------------------
app.command("up", rich_help_panel=DEPLOY)(up.up)
app.command("down", rich_help_panel=DEPLOY)(down.down)
app.command("ps", rich_help_panel=DEPLOY)(ps.ps)
app.command("logs", rich_help_panel=DEPLOY)(logs.logs)
certs_app = _group("certs", "TLS material: a CA, the aggregator's and each node's certs.",
                   DEPLOY)
certs_app.command("init")(certs.init)
certs_app.command("server")(certs.server)
certs_app.command("node")(certs.node)
certs_app.command("operator")(certs.operator)
certs_app.command("k8s-secrets")(certs.k8s_secrets)
certs_app.command("request")(certs_request.request)
certs_app.command("sign")(certs_request.sign)
kit_app = _group("kit", "Startup kits: one directory per site ('fedgpu node start --kit DIR') "
                 "and per person (a saved connection).", DEPLOY)
kit_app.command("site")(kit_commands.site)
kit_app.command("operator")(kit_commands.operator)
server_app = _group("server", "The aggregator.", DEPLOY)
server_app.command("start")(server_start.start)
server_app.command("stop")(server_stop.stop)

# ---- Operate a federation ------------------------------------------------------------------
connection_app = _group(
    "connection", "Saved connections to aggregators: address, CA and operator credential "
    "under a name, for every command that asks an aggregator.", OPERATE)
connection_app.command("add")(connection.add)
connection_app.command("list")(connection.list_connections)
connection_app.command("show")(connection.show)
connection_app.command("use")(connection.use)
connection_app.command("remove")(connection.remove)
connection_app.command("save-compose")(connection.save_compose)
app.command("status", rich_help_panel=OPERATE)(status.status)
# `fedgpu nodes` lists them; `fedgpu nodes forget NODE` retires one.
nodes_app = typer.Typer(help=nodes.nodes.__doc__, invoke_without_command=True)
nodes_app.callback(invoke_without_command=True)(nodes.nodes)
nodes_app.command("forget")(nodes.forget)
app.add_typer(nodes_app, name="nodes", rich_help_panel=OPERATE)
app.command("rounds", rich_help_panel=OPERATE)(rounds.rounds)
job_app = _group("job", "Jobs on a running federation: submit, list, follow, stop, download "
                 "(operator credential).", OPERATE)
job_app.command("submit")(job_submit.submit)
job_app.command("list")(job_list.list_jobs)
job_app.command("status")(job_status.status)
job_app.command("stop")(job_stop.stop)
job_app.command("logs")(job_logs.logs)
job_app.command("model")(job_model.model)
app.command("ui", rich_help_panel=OPERATE)(ui.ui)
users_app = _group("users", "People and their roles (admin, researcher, viewer): add, list, "
                   "revoke (admins only).", OPERATE)
users_app.command("add")(users.add)
users_app.command("list")(users.list_users)
users_app.command("revoke")(users.revoke)
studies_app = _group("studies", "Studies: the sites a study's jobs sample from (create, enrol, "
                     "withdraw, remove: admins only; list).", OPERATE)
studies_app.command("create")(studies.create)
studies_app.command("enrol")(studies.enrol)
studies_app.command("withdraw")(studies.withdraw)
studies_app.command("remove")(studies.remove)
studies_app.command("list")(studies.list_studies)
audit_app = _group("audit", "The hash-chained audit log of an aggregator or a site: show it, "
                   "verify its chain.", OPERATE)
audit_app.command("show")(audit.show)
audit_app.command("verify")(audit.verify)

# ---- Sites ---------------------------------------------------------------------------------
node_app = _group("node", "The training agent, and the site's allow-list of task bundles.",
                  SITES)
node_app.command("start")(node_start.start)
node_app.command("start-many")(node_start_many.start_many)
node_app.command("factory", context_settings={"allow_extra_args": False})(
    node_factory.factory)
node_app.command("health")(node_health.health)
node_app.command("approve")(node_approve.approve)
node_app.command("reject")(node_approve.reject)
node_app.command("tasks")(node_tasks.tasks)

# ---- Tasks and data ------------------------------------------------------------------------
task_app = _group("task", "Your own task as a bundle shipped with jobs: write one, check it.",
                  TASKS)
task_app.command("new")(task_new.new)
task_app.command("check")(task_check.check)
data_app = _group("data", "Datasets for demos and tests: per-node partitions, made locally.",
                  TASKS)
data_app.command("split")(data.split)
data_app.command("synth-images")(data.synth_images_cmd)
data_app.command("split-folder")(data.split_folder_cmd)
data_app.command("synth-lm")(synth_lm.synth_lm_cmd)

# ---- Diagnostics ---------------------------------------------------------------------------
app.command("doctor", rich_help_panel=DIAGNOSE)(doctor.doctor)
app.command("devices", rich_help_panel=DIAGNOSE)(devices.devices)
app.command("health", rich_help_panel=DIAGNOSE)(health.health)


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
