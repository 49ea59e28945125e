"""Starting an admitted task's round: its worker (or data-parallel workers) on the devices the
node's GPU admission gave it, with the task's arguments (a bundle's section, local DP, the
site's own layers) in task.json. The agent (node/agent.py) decides whether a task runs; this
module only runs it, so the agent's loop stays about tasks, not about processes."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path

from fedgpu.node import policy, ring
from fedgpu.node.agent_config import AgentConfig
from fedgpu.node.bundle_keeper import BundleKeeper
from fedgpu.node.gpu_sampler import MemorySampler
from fedgpu.node.rounds import local_dp, local_state
from fedgpu.node.rounds.ddp_launch import run_workers
from fedgpu.node.rounds.factory_client import FactoryClient
from fedgpu.node.rounds.process import RoundOutcome, Worker, run_task
from fedgpu.proto import pb


def launch(header: pb.TaskHeader, kind: str, payload: bytearray | None, hparams_json: str,
           decision: policy.Decision, decisions: list[policy.Decision], *, cfg: AgentConfig,
           bundles: BundleKeeper, layers_dir: Path, sampler: MemorySampler,
           factory: FactoryClient | None, track: Callable[[Worker | None], None],
           cancel: threading.Event) -> tuple[RoundOutcome | None, str]:
    """The round's outcome (None: it never started) and the error that stopped it, if any."""
    try:
        hparams = json.loads(hparams_json or "{}")
    except json.JSONDecodeError:
        hparams = None
    args = ring.task_args(header, cfg.name, cfg.work_root, decision)
    section, error = bundles.prepare(header.bundle) if header.HasField("bundle") else ({}, "")
    if not isinstance(hparams, dict):
        return None, "hyperparameters are not a JSON object"
    if section is None:
        return None, error
    # A bundle's section rides in task.json beside the mode's (ring's) own, and so does local
    # DP's; the site's own layers (local_params) live in `layers_dir`.
    args["extra"] = {**args.get("extra", {}), **section, **local_dp.from_header(header),
                     local_state.TASK_KEY: str(layers_dir)}
    # OSError starting the round is caught inside run_task (a failed outcome). Only training
    # is data-parallel: init and evaluate need one process.
    parallel = len(decisions) > 1 and kind == "train"
    start = partial(run_workers, decisions=decisions) if parallel else run_task
    outcome = start(
        kind=kind,
        task_name=header.task_name,
        hyperparameters=hparams,
        seed=header.seed,
        round_number=header.round,
        data_dir=cfg.data_dir,
        payload=payload,
        work_root=cfg.work_root,
        sampler=sampler,
        torch_threads=cfg.torch_threads,
        output=cfg.worker_output,
        **({"decision": decision, "factory": factory, "node_name": cfg.name}
           if not parallel else {}),
        track=track,
        cancel=cancel,
        **args,
    )
    return outcome, outcome.error
