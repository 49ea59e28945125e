"""`fedgpu report`: plots and a summary of a run, live or finished."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedgpu.cli.tls_options import OperatorToken, TlsCa, TlsCert, TlsKey
from fedgpu.core.errors import ConfigError


def report(
    out: Annotated[Path, typer.Option("--out", help="Directory for the PNGs and summary.md.")],
    address: Annotated[str | None, typer.Option(
        "--address", help="A running aggregator's HOST:PORT (asks its Admin service).")] = None,
    token: OperatorToken = None,
    state_dir: Annotated[Path | None, typer.Option(
        "--state-dir", help="A finished or running aggregator's --state-dir (or one job's "
        "directory in it, jobs/ID).")] = None,
    job: Annotated[str, typer.Option(
        "--job", help="Which job (with --address or --state-dir); default: the running job, "
        "else the latest.")] = "",
    rounds_json: Annotated[Path | None, typer.Option(
        "--rounds-json", help="A `fedgpu rounds --json` document, e.g. runs/<time>/rounds.json."
    )] = None,
    tls_cert: TlsCert = None, tls_key: TlsKey = None, tls_ca: TlsCa = None,
) -> None:
    """PNG plots of a run's rounds (loss/accuracy, per-node accuracy and memory, round time)
    and summary.md with the numbers."""
    # Imported here: the aggregator loads this CLI too and must not pay for (or lack) plotting.
    from fedgpu.cli import report as rep

    given = [name for name, v in (("--address", address), ("--state-dir", state_dir),
                                  ("--rounds-json", rounds_json)) if v is not None]
    if len(given) != 1:
        raise ConfigError("give exactly one source: --address HOST:PORT (a running aggregator), "
                          "--state-dir DIR (its checkpoints) or --rounds-json FILE"
                          + (f"; got {' and '.join(given)}" if given else ""))
    if address is not None:
        from fedgpu.core.tls import from_options

        hist = rep.load_aggregator(address, token, from_options(tls_cert, tls_key, tls_ca),
                                   job)
    elif state_dir is not None:
        hist = rep.load_state_dir(state_dir, job)
    else:
        assert rounds_json is not None
        hist = rep.load_json_file(rounds_json)
    for path in rep.write_report(hist, out):
        typer.echo(str(path))


def register(app: typer.Typer) -> None:
    app.command("report")(report)
