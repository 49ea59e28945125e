"""The `fedgpu` command tree as a reader finds it: every command where its name says, in a help
panel, with an example, flags shown as flags, and one connection option set wherever a
command asks an aggregator."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from fedgpu.cli.app import app
from tests.fixtures.federation import ROOT, base_env

CONNECTION_SET = {"--connection", "--address", "--token", "--tls-ca", "--tls-cert", "--tls-key",
                  "--insecure"}
# The commands that ask a running aggregator (the operator's side of the wire).
ASK_AGGREGATOR = {"status", "nodes forget", "rounds", "health", "report", "connection show",
                  "job submit", "job list", "job status", "job stop", "job logs", "job model"}
DEPLOY = {"up", "down", "ps", "logs"}


def _leaves(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    sub = getattr(cmd, "commands", None)
    if not sub:
        yield path, cmd
        return
    for name, child in sub.items():
        yield from _leaves(child, (*path, name))


LEAVES = list(_leaves(typer.main.get_command(app)))
IDS = [" ".join(p) for p, _ in LEAVES]


def _help(path: tuple[str, ...], columns: int = 80) -> str:
    r = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": str(columns)})
    assert r.exit_code == 0, r.output
    return r.output


@pytest.mark.parametrize(("path", "cmd"), LEAVES, ids=IDS)
def test_each_command_lives_where_its_name_says(path: tuple[str, ...], cmd: Any) -> None:
    module = cmd.callback.__module__
    if path[0] in DEPLOY:
        assert module == f"fedgpu.cli.deploy.{path[0]}"
        return
    # A group is a package with one module per command, or one module when small.
    wanted = [f"fedgpu.cli.{path[0]}", ".".join(["fedgpu.cli", *(p.replace("-", "_")
                                                                 for p in path)])]
    if len(path) == 1:
        wanted.append(f"fedgpu.cli.{path[0]}.{path[0]}")  # a command with helpers beside it
    if path[0] == "certs":
        # `certs request|sign` sit beside the one-module group, in cli/certs_request.py, until
        # the group becomes a package.
        wanted.append("fedgpu.cli.certs_request")
    assert module in wanted or (len(path) == 2 and module.startswith(f"fedgpu.cli.{path[0]}.")), \
        f"'fedgpu {' '.join(path)}' is defined in {module}"


@pytest.mark.parametrize(("path", "cmd"), LEAVES, ids=IDS)
def test_each_command_has_an_example_and_flags_as_flags(path: tuple[str, ...],
                                                        cmd: Any) -> None:
    text = _help(path)
    assert re.search(r"Examples?: fedgpu " + re.escape(path[0]), text), text
    assert "<bool>" not in text, text
    names = [o for p in cmd.params for o in (*p.opts, *getattr(p, "secondary_opts", []))]
    assert len(names) == len(set(names)), f"an option name is used twice: {sorted(names)}"
    if " ".join(path) in ASK_AGGREGATOR:
        opts = {o for p in cmd.params for o in p.opts}
        assert CONNECTION_SET <= opts, f"missing {CONNECTION_SET - opts}"


def test_a_group_that_is_also_a_command_takes_the_connection_set() -> None:
    # `fedgpu nodes` lists, `fedgpu nodes forget NAME` removes: both ask the aggregator.
    group = typer.main.get_command(app).commands["nodes"]  # type: ignore[attr-defined]
    assert CONNECTION_SET | {"--json"} <= {o for p in group.params for o in p.opts}
    assert "Example: fedgpu nodes" in _help(("nodes",))


def test_the_root_groups_commands_in_panels() -> None:
    text = _help(())
    panels = re.findall(r"╭─ (.+?) ─", text)
    assert panels[:1] == ["Options"]
    assert {"Run locally", "Deploy", "Operate a federation", "Sites", "Tasks and data",
            "Diagnostics"} <= set(panels)
    # Every top-level command is in some panel, none in a catch-all "Commands" one.
    assert "Commands" not in panels


def test_help_text_is_not_eaten_as_markup() -> None:
    text = " ".join(_help(("task", "check"), columns=300).split())
    assert "The job's , as" not in text
    assert "hyperparameters table, as a JSON object" in text


def test_version_prints_the_installed_version() -> None:
    r = subprocess.run([sys.executable, "-m", "fedgpu.cli.app", "--version"],
                       capture_output=True, text=True, env=base_env(), cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"fedgpu {metadata.version('fedgpu')}"


def test_no_command_registers_itself() -> None:
    # app.py is the one place that builds the tree: no module hooks itself in on import.
    for path in (ROOT / "fedgpu" / "cli").rglob("*.py"):
        text = path.read_text()
        if path.name == "app.py":
            continue
        assert not re.search(r"^def register\(|\.add_typer\(|@\w+\.command\(", text, re.M), \
            f"{path.relative_to(ROOT)} registers commands itself"


def test_every_import_of_the_cli_package_resolves() -> None:
    # Commands import their helpers inside the function (light start-up), where a stale
    # module path fails only when that command runs: check them all here.
    import ast
    import importlib

    for path in (ROOT / "fedgpu" / "cli").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fedgpu.cli"):
                module = importlib.import_module(node.module)  # type: ignore[arg-type]
                for alias in node.names:
                    assert hasattr(module, alias.name) or importlib.util.find_spec(
                        f"{node.module}.{alias.name}") is not None, \
                        f"{path.relative_to(ROOT)}: {node.module} has no {alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("fedgpu.cli"):
                        importlib.import_module(alias.name)
