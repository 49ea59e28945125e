"""Options the `fedgpu node` commands share: the site's state directory, task approval, the
agent's status file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedgpu.core.constants import TaskApproval

STATUS_HELP = "Status file the agent refreshes (read by 'fedgpu node health')."
# `approved` everywhere (image, compose, plain CLI): a node started by hand behaves like one in
# a container, and it is as safe as `installed` (no code from the wire runs until the site
# approves its hash) while a job with a bundle waits visibly instead of failing.
TaskApprovalOpt = Annotated[TaskApproval, typer.Option(
    envvar="FEDGPU_TASK_APPROVAL", case_sensitive=False,
    help="Task bundles sent with jobs: 'installed' runs installed tasks only; 'approved' also "
         "runs bundles whose sha256 this site approved ('fedgpu node approve'); 'any' runs "
         "every bundle (local demos only).")]
StateDirOpt = Annotated[Path | None, typer.Option(
    envvar="FEDGPU_NODE_STATE",
    help="The site's state: its bundle cache and allow-list (default: "
         "$XDG_STATE_HOME/fedgpu/node, i.e. ~/.local/state/fedgpu/node).")]
