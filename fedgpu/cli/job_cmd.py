"""`fedgpu job submit|list|status|stop|logs|model`: jobs on a federation that stays up.

Every command asks the aggregator with the operator credential and prints a table (or a
line) for people, or with --json exactly one JSON document (`logs --follow --json`: one
event per line, as they come).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from fedgpu.cli.bundle_jobs import task_dir_of
from fedgpu.cli.report import fmt_value
from fedgpu.cli.tls_options import Address, AsJson, OperatorToken, TlsCa, TlsCert, TlsKey
from fedgpu.core import admin_client
from fedgpu.core.bundles import pack_dir
from fedgpu.core.config import MAX_JOB_FILE_BYTES
from fedgpu.core.errors import ConfigError
from fedgpu.core.tls import from_options

job_app = typer.Typer(help="Jobs on a running federation: submit, list, follow, stop, "
                      "download (operator credential).", no_args_is_help=True)
JobId = Annotated[str, typer.Argument(help="The job id that 'fedgpu job submit' printed.")]
DEFAULT_ADDRESS = "localhost:50051"


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _print(doc: Any) -> None:
    typer.echo(json.dumps(doc, indent=2))


@job_app.command("submit")
def submit(job_file: Annotated[Path, typer.Argument(help="The job file (TOML).")],
           task_dir: Annotated[Path | None, typer.Option(
               "--task-dir", help="A task bundle directory (fedgpu-task.toml and sources), "
                                  "packed and sent with the job; overrides the job file's "
                                  "task_dir.")] = None,
           address: Address = DEFAULT_ADDRESS, token: OperatorToken = None,
           as_json: AsJson = False, tls_cert: TlsCert = None, tls_key: TlsKey = None,
           tls_ca: TlsCa = None) -> None:
    """Queue a job (and its task bundle); it runs when the jobs before it have ended."""
    try:
        size = job_file.stat().st_size
    except OSError as exc:
        raise ConfigError(f"cannot read job file {job_file}: {exc.strerror}") from None
    if size > MAX_JOB_FILE_BYTES:
        raise ConfigError(f"job file {job_file} is {size} bytes; the limit is "
                          f"{MAX_JOB_FILE_BYTES}")
    text = job_file.read_text()
    bundle = None
    folder = task_dir_of(job_file, text, task_dir)
    if folder is not None:
        bundle = pack_dir(folder)
        # On stderr: with --json, stdout is the one document.
        typer.echo(f"task bundle {bundle.manifest.name!r} from {folder}: sha256 "
                   f"{bundle.sha256} ({len(bundle.files)} files, {bundle.size:,} bytes)",
                   err=True)
    doc = admin_client.submit_job(address, token, text, str(job_file),
                                  bundle=bundle.data if bundle is not None else None,
                                  tls=from_options(tls_cert, tls_key, tls_ca))
    if as_json:
        _print(doc)
    else:
        typer.echo(f"job {doc['job_id']} {doc['state']}")


@job_app.command("list")
def list_jobs(address: Address = DEFAULT_ADDRESS, token: OperatorToken = None,
              as_json: AsJson = False, tls_cert: TlsCert = None, tls_key: TlsKey = None,
              tls_ca: TlsCa = None) -> None:
    """Every job, oldest first: state, progress, latest accuracy."""
    doc = admin_client.query(address, token, "ListJobs",
                             tls=from_options(tls_cert, tls_key, tls_ca))
    if as_json:
        _print(doc)
        return
    table = Table("job", "name", "task", "state", "rounds", "accuracy", "loss", "submitted",
                  "note")
    for j in doc:
        table.add_row(j["job_id"], j["name"], j["task"], j["state"],
                      f"{j['rounds_done']}/{j['rounds']}", fmt_value(j["accuracy"]),
                      fmt_value(j["loss"]), _when(j["submitted_at"]),
                      j["error"] or j["reason"] or "")
    Console().print(table)


@job_app.command("status")
def status(job_id: JobId, address: Address = DEFAULT_ADDRESS, token: OperatorToken = None,
           as_json: AsJson = False, tls_cert: TlsCert = None, tls_key: TlsKey = None,
           tls_ca: TlsCa = None) -> None:
    """One job: its state, the open round, and each node's part in it (or why not)."""
    doc = admin_client.query(address, token, "GetJob", job_id=job_id,
                             tls=from_options(tls_cert, tls_key, tls_ca))
    if as_json:
        _print(doc)
        return
    lines = [f"job {doc['job_id']} ({doc['name']}, task {doc['task']}): {doc['state']}"
             + (f" — {doc['reason']}" if doc["reason"] else ""),
             f"rounds {doc['rounds_done']}/{doc['rounds']}  accuracy "
             f"{fmt_value(doc['accuracy'])}  loss {fmt_value(doc['loss'])}"]
    if doc.get("bundle_sha256"):
        lines.append(f"task bundle {doc['bundle_name']!r}: sha256 {doc['bundle_sha256']} "
                     f"({doc['bundle_size']:,} bytes)")
    cur = doc.get("current_round")
    if cur:
        lines.append(f"open: round {cur['round']} ({cur['kind']}, attempt {cur['attempt']}) "
                     f"{cur['accepted']}/{cur['participants']} updates, deadline in "
                     f"{cur['deadline_in_s']}s")
    if doc.get("privacy"):
        p = doc["privacy"]
        budget = f" of {p['target_epsilon']:g}" if p["target_epsilon"] is not None else ""
        lines.append(f"privacy ({p['mode']}): epsilon {fmt_value(p['epsilon_spent'])}{budget} "
                     f"spent at delta {p['delta']:g} over {p['rounds_accounted']} round(s)")
    if doc["error"]:
        lines.append(f"error: {doc['error']}")
    typer.echo("\n".join(lines))
    if doc.get("nodes"):
        table = Table("node", "state", "taking part", "why not")
        for n in doc["nodes"]:
            table.add_row(n["name"], n["state"], "yes" if n["eligible"] else "no",
                          n["reason"] or "")
        Console().print(table)


@job_app.command("stop")
def stop(job_id: JobId, address: Address = DEFAULT_ADDRESS, token: OperatorToken = None,
         as_json: AsJson = False, tls_cert: TlsCert = None, tls_key: TlsKey = None,
         tls_ca: TlsCa = None) -> None:
    """Stop a queued or running job; nodes abandon its round."""
    doc = admin_client.query(address, token, "StopJob", job_id=job_id,
                             tls=from_options(tls_cert, tls_key, tls_ca))
    if as_json:
        _print(doc)
    else:
        typer.echo(f"job {doc['job_id']} {doc['state']}")


def _event_line(e: dict[str, Any]) -> str:
    who = e["source"] + (f" {e['node']}" if e.get("node") else "")
    return f"{_when(e['time'])} {e['level']:<7} {who}: {e['message']}"


@job_app.command("logs")
def logs(job_id: JobId,
         follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new "
                                              "events until the job ends (Ctrl-C stops).")]
         = False,
         address: Address = DEFAULT_ADDRESS, token: OperatorToken = None,
         as_json: AsJson = False, tls_cert: TlsCert = None, tls_key: TlsKey = None,
         tls_ca: TlsCa = None) -> None:
    """The aggregator's events for a job and the errors its nodes reported."""
    events = admin_client.job_logs(address, token, job_id, follow=follow,
                                   tls=from_options(tls_cert, tls_key, tls_ca))
    if as_json and not follow:
        _print(list(events))
        return
    for event in events:
        typer.echo(json.dumps(event) if as_json else _event_line(event))


@job_app.command("model")
def model(job_id: JobId,
          out: Annotated[Path, typer.Option("--out", "-o", help="Where to write the model "
                                            "(safetensors).")],
          address: Address = DEFAULT_ADDRESS, token: OperatorToken = None,
          as_json: AsJson = False, tls_cert: TlsCert = None, tls_key: TlsKey = None,
          tls_ca: TlsCa = None) -> None:
    """Download the job's latest global model as a safetensors file."""
    doc = admin_client.download_model(address, token, job_id, out,
                                      tls=from_options(tls_cert, tls_key, tls_ca))
    if as_json:
        _print(doc)
    else:
        typer.echo(f"job {doc['job_id']}: global model of round {doc['round']} -> {out} "
                   f"({doc['size']:,} bytes, sha256 {doc['sha256'][:16]}...)")


def register(app: typer.Typer) -> None:
    app.add_typer(job_app, name="job")
