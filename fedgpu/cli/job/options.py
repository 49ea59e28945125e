"""Options of several `fedgpu job` commands."""

from __future__ import annotations

from typing import Annotated

import typer

JobId = Annotated[str, typer.Argument(
    help="The job's id, or its first characters if no other job's id starts with them "
         "('fedgpu job list').")]
