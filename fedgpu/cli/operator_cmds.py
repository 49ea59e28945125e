"""The operator's commands (report, doctor, deploy, ui), registered together so app.py needs one
hook; each module imports its heavy dependencies (matplotlib, docker) only when run."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    from fedgpu.cli import deploy_cmd, doctor_cmd, report_cmd, ui_cmd

    for module in (report_cmd, doctor_cmd, deploy_cmd, ui_cmd):
        module.register(app)
