"""The `fedgpu.v1.Admin` service: the documents `fedgpu status|nodes|rounds --json` print."""

from __future__ import annotations

import json
import time
from typing import Any

import grpc

import fedgpu
from fedgpu.proto import admin_pb2, admin_pb2_grpc
from fedgpu.server.auth import TokenAuth
from fedgpu.server.plans import KIND_NAMES
from fedgpu.server.registry import Registry
from fedgpu.server.rounds import Orchestrator


def status_doc(orch: Orchestrator, registry: Registry) -> dict[str, Any]:
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
        "started_at": orch.started_at,
        "finished_at": orch.finished_at,
        "uptime_s": round(time.time() - orch.started_at, 1),
        "job": orch.job.to_dict(),
        "version": fedgpu.__version__,
    }


def rounds_doc(orch: Orchestrator) -> dict[str, Any]:
    return orch.rounds_doc()


def nodes_doc(registry: Registry) -> dict[str, Any]:
    return {"nodes": registry.snapshot()}


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, orch: Orchestrator, registry: Registry, auth: TokenAuth) -> None:
        self.orch = orch
        self.registry = registry
        self.auth = auth

    async def GetStatus(self, request: Any, context: grpc.aio.ServicerContext
                        ) -> admin_pb2.JsonReply:
        await self.auth.check(context)
        return admin_pb2.JsonReply(json=json.dumps(status_doc(self.orch, self.registry)))

    async def ListRounds(self, request: Any, context: grpc.aio.ServicerContext
                         ) -> admin_pb2.JsonReply:
        await self.auth.check(context)
        return admin_pb2.JsonReply(json=json.dumps(rounds_doc(self.orch)))

    async def ListNodes(self, request: Any, context: grpc.aio.ServicerContext
                        ) -> admin_pb2.JsonReply:
        await self.auth.check(context)
        return admin_pb2.JsonReply(json=json.dumps(nodes_doc(self.registry)))
