"""`fedgpu job submit`: queue a job file (and the task bundle it names) on a running
federation. The `fedgpu job` commands each live in a module of this package, one per command;
they ask the aggregator with the operator credential and print a table (or a line) for people,
or with --json exactly one JSON document (`logs --follow --json`: one event per line)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedgpu.cli.common.connect import Target, connection_options
from fedgpu.cli.common.options import WATCH_INTERVAL_S, AsJson
from fedgpu.cli.common.output import print_json
from fedgpu.cli.job.precheck import Precheck
from fedgpu.core import admin_client
from fedgpu.core.bundles import pack_dir
from fedgpu.core.errors import FedgpuError
from fedgpu.core.job import Job, read_job_file


@connection_options
def submit(conn: Target, job_file: Annotated[Path, typer.Argument(help="The job file (TOML).")],
           task_dir: Annotated[Path | None, typer.Option(
               "--task-dir", help="A task bundle directory (fedgpu-task.toml and sources), "
                                  "packed and sent with the job; overrides the job file's "
                                  "task_dir.")] = None,
           weights_on_aggregator: Annotated[bool, typer.Option(
               "--weights-on-aggregator",
               help="The job file's initial_weights names a file of the aggregator's "
                    "--initial-weights-dir: nothing is uploaded (by default the file is "
                    "read here and sent with the job).")] = False,
           watch: Annotated[bool, typer.Option(
               "--watch", help="Then follow this job round by round until it ends, as "
                               "'fedgpu status --watch --job ID' does (exit code 1 when it "
                               "fails or is stopped).")] = False,
           queue_anyway: Annotated[bool, typer.Option(
               "--queue-anyway",
               help="Queue the job even when fewer than min_nodes connected sites would "
                    "accept it by their advertised policies (sites may join or change "
                    "later).")] = False,
           as_json: AsJson = False) -> None:
    """Queue a job (and its task bundle and initial weights, both sent with it); it runs when
    the jobs before it have ended.

    Examples: fedgpu job submit compose/job.toml; fedgpu job submit job.toml --watch
    """
    if watch and as_json:
        # --json promises one document; a watch prints one per change (status --watch --json).
        raise typer.BadParameter("--watch prints as it goes: without --json, or submit with "
                                 "--json and then 'fedgpu status --watch --json --job ID'",
                                 param_hint="--watch")
    # Read and checked here by the job schema, as the aggregator will check it again: a
    # mistake is named before anything is packed or uploaded.
    jf = read_job_file(job_file)
    bundle = None
    folder = task_dir if task_dir is not None else jf.task_dir
    if folder is not None:
        bundle = pack_dir(folder)
        # On stderr: with --json, stdout is the one document.
        typer.echo(f"task bundle {bundle.manifest.name!r} from {folder}: sha256 "
                   f"{bundle.sha256} ({len(bundle.files)} files, {bundle.size:,} bytes)",
                   err=True)
    check = _ask_sites(conn, jf.job, bundle.sha256 if bundle is not None else "",
                       queue_anyway)
    weights = None if weights_on_aggregator else jf.initial_weights
    doc = admin_client.submit_job(conn.address, conn.token, jf.text, str(job_file),
                                  bundle=bundle.data if bundle is not None else None,
                                  tls=conn.tls, weights=weights)
    for warning in doc.get("warnings") or []:
        # On stderr: the job is queued all the same, and stdout stays the one document/line.
        typer.echo(f"warning: {warning}", err=True)
    if as_json:
        if check.refusing or check.hours:
            doc["site_policies"] = check.to_dict()
        print_json(doc)
    else:
        typer.echo(f"job {doc['job_id']} {doc['state']}")
        est = doc.get("estimate")
        if est:
            # On stderr: stdout stays the one line scripts read.
            typer.echo(f"{'warning: ' if est.get('long') else ''}training time: {est['text']}",
                       err=True)
    if watch:
        _follow(conn, doc["job_id"])


def _ask_sites(conn: Target, job: Job, bundle_sha256: str, queue_anyway: bool) -> Precheck:
    """Which connected sites would refuse the job by their own policy, said on stderr before
    anything is queued; too few left to run it: nothing is queued (unless --queue-anyway)."""
    from fedgpu.cli.job.precheck import precheck
    from fedgpu.core.site_policy import terms_of

    check = precheck(conn.address, conn.token, conn.tls, terms_of(job, "", bundle_sha256))
    for name, reasons in check.refusing.items():
        typer.echo(f"site {name} would refuse this job: {'; '.join(reasons)}", err=True)
    for name, window in check.hours.items():
        typer.echo(f"site {name} trains only {window}", err=True)
    if check.refusing and check.accepting < job.min_nodes:
        msg = (f"{check.accepting} of {check.alive} connected site(s) would accept this job "
               f"and it needs min_nodes = {job.min_nodes}: " + "; ".join(
                   f"{n}: {'; '.join(r)}" for n, r in check.refusing.items()))
        if not queue_anyway:
            raise FedgpuError(f"not queued: {msg} (change the job, or pass --queue-anyway "
                              "to wait for sites that would accept it)")
        typer.echo(f"warning: {msg}; queued anyway (--queue-anyway)", err=True)
    return check


def _follow(conn: Target, job_id: str) -> None:
    """`fedgpu status --watch --job JOB_ID`: by its id, not "the current job", which is still
    the previous one until the queue has started this one."""
    from fedgpu.cli.common.watch import watch_status
    from fedgpu.cli.status import show_status
    from fedgpu.core.lifetime import restore_ctrl_c

    restore_ctrl_c()  # as status --watch: Ctrl-C stops following, even from a script's `&`
    watch_status(conn.address, conn.token, conn.tls, False, WATCH_INTERVAL_S, show_status,
                 job_id)
