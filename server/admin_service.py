"""The `fedgpu.v1.Admin` service: the documents `fedgpu status|nodes|rounds --json` print."""

from __future__ import annotations

import time
from typing import Any

import grpc

import fedgpu
from fedgpu.core import jsondoc
from fedgpu.proto import admin_pb2, admin_pb2_grpc
from fedgpu.server import paging
from fedgpu.server.auth import TokenAuth
from fedgpu.server.plans import KIND_NAMES
from fedgpu.server.registry import Registry
from fedgpu.server.rounds import Orchestrator
from fedgpu.server.uploads import Uploads


def status_doc(orch: Orchestrator, registry: Registry, uploads: Uploads | None = None
               ) -> dict[str, Any]:
    rnd = orch.current
    latest = orch.history.latest_eval()
    return {
        "run_id": orch.run_id,
        "state": orch.state,
        "error": orch.error,
        "task": orch.job.task,
        "mode": orch.job.mode,
        "strategy": orch.job.strategy,
        "round": orch.global_round,
        "rounds": orch.job.rounds,
        "current_round": None if rnd is None else {
            "round": rnd.number,
            "kind": KIND_NAMES.get(rnd.kind, "?"),
            "attempt": rnd.attempt,
            "participants": len(rnd.slots),
            "accepted": rnd.accepted(),
            "outstanding": rnd.outstanding(),
            "deadline_in_s": round(max(0.0, rnd.deadline - time.time()), 1),
        },
        "nodes": {"registered": len(registry.all()), "alive": len(registry.alive())},
        "accuracy": None if latest is None else latest.accuracy,
        "loss": None if latest is None else latest.loss,
        "rejections": dict(orch.rejections),
        # Update streams being received now: stalled ones, those timed out so far, memory.
        "uploads": uploads.stats() if uploads is not None else None,
        "started_at": orch.started_at,
        "finished_at": orch.finished_at,
        "uptime_s": round(time.time() - orch.started_at, 1),
        "job": orch.job.to_dict(),
        "version": fedgpu.__version__,
    }


def rounds_page(orch: Orchestrator, offset: int = 0) -> str:
    """`fedgpu rounds --json`, from round record `offset` on, as much as fits one reply."""
    doc = orch.rounds_doc()
    return paging.page({k: v for k, v in doc.items() if k != "rounds"}, "rounds",
                       doc["rounds"], offset)


def nodes_page(registry: Registry, offset: int = 0) -> str:
    """`fedgpu nodes --json`, from node `offset` on (by name), as much as fits one reply."""
    return paging.page({}, "nodes", registry.snapshot(), offset)


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, orch: Orchestrator, registry: Registry, auth: TokenAuth,
                 uploads: Uploads | None = None) -> None:
        self.orch = orch
        self.registry = registry
        self.auth = auth
        self.uploads = uploads

    async def GetStatus(self, request: Any, context: grpc.aio.ServicerContext
                        ) -> admin_pb2.JsonReply:
        await self.auth.check(context)
        doc = status_doc(self.orch, self.registry, self.uploads)
        return admin_pb2.JsonReply(json=jsondoc.dumps(doc))

    async def ListRounds(self, request: Any, context: grpc.aio.ServicerContext
                         ) -> admin_pb2.JsonReply:
        await self.auth.check(context)
        return admin_pb2.JsonReply(json=rounds_page(self.orch, request.offset))

    async def ListNodes(self, request: Any, context: grpc.aio.ServicerContext
                        ) -> admin_pb2.JsonReply:
        await self.auth.check(context)
        return admin_pb2.JsonReply(json=nodes_page(self.registry, request.offset))
