"""`fedgpu job stop`: stop a job and wait until the aggregator says it has ended."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from fedgpu.cli.common import ids
from fedgpu.cli.common.connect import Target, connection_options
from fedgpu.cli.common.options import AsJson
from fedgpu.cli.common.output import print_json
from fedgpu.cli.job.options import JobId
from fedgpu.core import admin_client
from fedgpu.core.constants import ENDED_JOB_STATES
from fedgpu.core.errors import FedgpuError

_ENDED = {str(s) for s in ENDED_JOB_STATES}
POLL_S = 0.2


@connection_options
def stop(conn: Target, job_id: JobId, as_json: AsJson = False,
         wait_s: Annotated[float, typer.Option(
             "--wait-s", min=0, help="Seconds to wait for the job to end (a running round "
             "is abandoned first); 0: print the state the stop left at once.")] = 30.0
         ) -> None:
    """Stop a queued or running job; nodes abandon its round. Prints the state it ended in.

    Example: fedgpu job stop 3f2a
    """
    full = ids.job_id(conn, job_id)
    doc = admin_client.query(conn.address, conn.token, "StopJob", tls=conn.tls, job_id=full)
    end = time.monotonic() + wait_s
    while doc["state"] not in _ENDED and time.monotonic() < end:
        time.sleep(POLL_S)
        now = admin_client.query(conn.address, conn.token, "GetJob", tls=conn.tls,
                                 job_id=full)
        # The StopJob reply's keys, with their values as they are now.
        doc = {k: now.get(k, v) for k, v in doc.items()}
    if as_json:
        print_json(doc)
    else:
        typer.echo(f"job {doc['job_id']} {doc['state']}")
    if wait_s and doc["state"] not in _ENDED:
        raise FedgpuError(f"job {doc['job_id']} is still {doc['state']} {wait_s:g}s after the "
                          "stop; 'fedgpu job status' follows it")
