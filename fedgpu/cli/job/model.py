"""`fedgpu job model`: download a job's latest global model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedgpu.cli.common import ids
from fedgpu.cli.common.connect import Target, connection_options
from fedgpu.cli.common.options import AsJson
from fedgpu.cli.common.output import print_json
from fedgpu.cli.job.options import JobId
from fedgpu.core import admin_client


@connection_options
def model(conn: Target, job_id: JobId,
          out: Annotated[Path, typer.Option("--out", "-o", help="Where to write the model "
                                            "(safetensors).")],
          as_json: AsJson = False) -> None:
    """Download the job's latest global model as a safetensors file.

    Example: fedgpu job model 3f2a --out model.safetensors
    """
    doc = admin_client.download_model(conn.address, conn.token, ids.job_id(conn, job_id), out,
                                      tls=conn.tls)
    if as_json:
        print_json(doc)
    else:
        typer.echo(f"job {doc['job_id']}: global model of round {doc['round']} -> {out} "
                   f"({doc['size']:,} bytes, sha256 {doc['sha256'][:16]}...)")
