"""`fedgpu report`: plots and a summary of a run, live or finished."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedgpu.cli.common import ids
from fedgpu.cli.common.connect import Origin, Target, connection_options
from fedgpu.core.errors import ConfigError


@connection_options
def report(
    conn: Target,
    out: Annotated[Path, typer.Option("--out", help="Directory for the PNGs and summary.md.")],
    state_dir: Annotated[Path | None, typer.Option(
        "--state-dir", help="A finished or running aggregator's --state-dir (or one job's "
        "directory in it, jobs/ID).")] = None,
    job: Annotated[str, typer.Option(
        "--job", help="Which job (with --address or --state-dir); default: the running job, "
        "else the latest.")] = "",
    rounds_json: Annotated[Path | None, typer.Option(
        "--rounds-json", help="A `fedgpu rounds --json` document, e.g. runs/<time>/rounds.json."
    )] = None,
) -> None:
    """PNG plots of a run's rounds (loss/accuracy, per-node accuracy and memory, round time)
    and summary.md with the numbers, from a running aggregator (--address or a saved
    connection), its --state-dir, or a rounds document.

    Examples: fedgpu report --out report/; fedgpu report --state-dir runs/x/state --out report/
    """
    # Imported here: the aggregator loads this CLI too and must not pay for (or lack) plotting.
    from fedgpu.cli.report import plots as rep

    files = [name for name, v in (("--state-dir", state_dir), ("--rounds-json", rounds_json))
             if v is not None]
    # An aggregator from the environment or the default connection is a source only when
    # no file is given.
    asked = conn.origin is Origin.COMMAND_LINE or (conn.origin is not Origin.BUILT_IN
                                                   and not files)
    given = (["--address"] if asked else []) + files
    if len(given) != 1:
        raise ConfigError("give exactly one source: --address HOST:PORT (a running aggregator), "
                          "--state-dir DIR (its checkpoints) or --rounds-json FILE"
                          + (f"; got {' and '.join(given)}" if given else ""))
    if asked:
        hist = rep.load_aggregator(conn.address, conn.token, conn.tls,
                                   ids.job_id(conn, job))
    elif state_dir is not None:
        hist = rep.load_state_dir(state_dir, job)
    else:
        assert rounds_json is not None
        hist = rep.load_json_file(rounds_json)
    for path in rep.write_report(hist, out):
        typer.echo(str(path))
