"""`fedgpu studies create|enrol|withdraw|remove|list`: studies on the aggregator
(server/studies.py): the sites, by node name, that the jobs naming a study sample from.
Changes are for admins; every role may list."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from fedgpu.cli.common.connect import Target, connection_options
from fedgpu.cli.common.options import AsJson
from fedgpu.cli.common.output import new_table, print_json, print_table, when
from fedgpu.core import admin_client
from fedgpu.core.people import check_name

Name = Annotated[str, typer.Argument(help="The study's name (a job's `study` key).")]
Sites = Annotated[list[str], typer.Argument(help="Node names (as `fedgpu nodes` lists them).")]


def _show(doc: dict[str, Any], verb: str, as_json: bool) -> None:
    if as_json:
        print_json(doc)
        return
    study = doc.get("study") or doc.get("removed") or {}
    sites = ", ".join(study.get("sites") or []) or "no sites"
    typer.echo(f"{verb} study {study.get('name')}: {sites}")
    if doc.get("not_registered"):
        typer.echo("not registered yet (enrolled by name; sampled once they connect): "
                   + ", ".join(doc["not_registered"]))


@connection_options
def create(conn: Target, name: Name, as_json: AsJson = False) -> None:
    """Create a study (admins only). Once a study exists, people's --study and jobs' `study`
    key must name existing studies.

    Example: fedgpu studies create onco
    """
    check_name(name, "study")
    doc = admin_client.query(conn.address, conn.token, "CreateStudy", tls=conn.tls, name=name)
    _show(doc, "created", as_json)


@connection_options
def enrol(conn: Target, name: Name, sites: Sites, as_json: AsJson = False) -> None:
    """Enrol sites in a study (admins only): the study's jobs sample only its sites. A site
    whose own policy does not serve the study refuses, with its reason.

    Example: fedgpu studies enrol onco hospital-a hospital-b
    """
    doc = admin_client.query(conn.address, conn.token, "EnrolSites", tls=conn.tls, name=name,
                             sites=sites)
    _show(doc, "enrolled in", as_json)


@connection_options
def withdraw(conn: Target, name: Name, sites: Sites, as_json: AsJson = False) -> None:
    """Withdraw sites from a study (admins only): its jobs no longer sample them from the
    next round on.

    Example: fedgpu studies withdraw onco hospital-b
    """
    doc = admin_client.query(conn.address, conn.token, "WithdrawSites", tls=conn.tls,
                             name=name, sites=sites)
    _show(doc, "withdrew from", as_json)


@connection_options
def remove(conn: Target, name: Name, as_json: AsJson = False) -> None:
    """Remove a study and its enrolments (admins only). Its jobs keep the name and wait
    until a study of that name exists again.

    Example: fedgpu studies remove onco
    """
    doc = admin_client.query(conn.address, conn.token, "RemoveStudy", tls=conn.tls, name=name)
    _show(doc, "removed", as_json)


@connection_options
def list_studies(conn: Target, as_json: AsJson = False) -> None:
    """The studies of this federation and their sites (live ones marked).

    Example: fedgpu studies list
    """
    doc = admin_client.query(conn.address, conn.token, "ListStudies", tls=conn.tls)
    if as_json:
        print_json(doc)
        return
    studies = doc.get("studies") or []
    if not studies:
        typer.echo("no studies yet: 'fedgpu studies create NAME' makes one (until then a "
                   "job's `study` is a label only and every site is sampled)")
        return
    table = new_table("study", "sites", "live", "created", "by")
    for s in studies:
        live = set(s.get("alive") or [])
        table.add_row(s["name"], ", ".join(s["sites"]) or "-", f"{len(live)}/{len(s['sites'])}",
                      when(s.get("created_at"), short=True), s.get("created_by") or "-")
    print_table(table)
