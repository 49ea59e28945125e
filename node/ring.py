"""The agent's side of ring mode: turn a task's RingAssignment into the ring worker's task.json.

Torch-free like the rest of the agent. The node's own model copy lives between blocks in a
directory per run and node name under the work root, so a node restarted mid-run finds it (and
a copy of another run is never picked up: the worker checks the run id and iteration).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

from fedgpu.node.policy import Decision
from fedgpu.proto import pb


def state_dir(work_root: Path | None, run_id: str, node_name: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", node_name)
    return Path(work_root or tempfile.gettempdir()) / f"fedgpu-ring-{run_id}-{safe}"


def task_args(header: pb.TaskHeader, node_name: str, work_root: Path | None,
              decision: Decision) -> dict[str, Any]:
    """Extra run_task arguments for a ring block; none for a star task."""
    if not header.HasField("ring"):
        return {}
    r = header.ring
    return {
        "worker_module": "fedgpu.node.ring_worker",
        "extra": {"ring": {
            "run_id": r.run_id,
            "rank": r.rank,
            "world_size": r.world_size,
            "master_addr": r.master_addr,
            "master_port": r.master_port,
            "first_iteration": r.first_iteration,
            "iterations": r.iterations,
            "total_iterations": r.total_iterations,
            "local_steps": r.local_steps,
            "mixing": list(r.mixing),
            "peers": list(r.peers),
            "restart": r.restart,
            "timeout_s": r.timeout_s,
            "state_dir": str(state_dir(work_root, r.run_id, node_name)),
            # nccl only if every rank has a GPU of its own: the ranks compare these.
            "gpu_uuid": decision.gpu_uuid if decision.device == "cuda" else "",
        }},
    }
