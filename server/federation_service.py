"""The `fedgpu.v1.Federation` service: thin gRPC glue over the registry and orchestrator."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from fedgpu.core import codec
from fedgpu.proto import pb, pb_grpc
from fedgpu.server.auth import TokenAuth
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rounds import Orchestrator
from fedgpu.server.states import Reject
from fedgpu.server.validation import UpdateRejected, decode_and_check

log = logging.getLogger("fedgpu.server.federation")

MAX_POLL_S = 30

# The gRPC status each refusal is answered with; anything else is INVALID_ARGUMENT.
STATUS_OF: dict[Reject, grpc.StatusCode] = {
    Reject.LATE: grpc.StatusCode.FAILED_PRECONDITION,
    Reject.STALE_ROUND: grpc.StatusCode.FAILED_PRECONDITION,
    Reject.DUPLICATE: grpc.StatusCode.ALREADY_EXISTS,
    Reject.NOT_SELECTED: grpc.StatusCode.PERMISSION_DENIED,
    Reject.WRONG_TASK: grpc.StatusCode.PERMISSION_DENIED,
    Reject.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def _as_dict(msg: Any) -> dict[str, Any]:
    return MessageToDict(msg, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)


class FederationService(pb_grpc.FederationServicer):
    def __init__(
        self,
        registry: Registry,
        orchestrator: Orchestrator,
        auth: TokenAuth,
        max_update_bytes: int,
        max_concurrent_uploads: int = 4,
    ) -> None:
        self.registry = registry
        self.orch = orchestrator
        self.auth = auth
        self.max_update_bytes = max_update_bytes
        # Each upload in flight holds one model-sized buffer: this bounds aggregator memory
        # to O(model x concurrency), never O(model x nodes).
        self._uploads = asyncio.Semaphore(max_concurrent_uploads)

    async def _node(self, node_id: str, context: grpc.aio.ServicerContext) -> Node:
        node = self.registry.get(node_id)
        if node is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"unknown node id {node_id!r}: register again (the aggregator may have restarted)",
            )
        assert node is not None
        # A certificate's holder may use only the ids registered under its own name; only a
        # call that passed this check counts as a sign of life (another site's certificate
        # must not keep a departed node looking alive).
        await self.auth.bind(context, node.name, "call")
        self.registry.touch(node.node_id)
        return node

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
                       ) -> pb.RegisterReply:
        await self.auth.check(context)
        name = request.node_name.strip()
        if not name or len(name) > 128:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "node_name must be 1-128 characters")
        task = self.orch.job.task
        if request.tasks and task not in request.tasks:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this federation runs task {task!r}, which is not installed on node {name!r} "
                f"(installed: {', '.join(request.tasks)}); install the package that provides "
                "it (entry-point group fedgpu.tasks) or fix the job's task name",
            )
        await self.auth.bind(context, name, "registration")
        node = self.registry.register(
            name=name,
            peer=context.peer(),
            version=request.version,
            devices=_as_dict(request.devices),
            decision=_as_dict(request.decision),
            labels=dict(request.labels),
            tasks=list(request.tasks),
        )
        node.ring_host, node.ring_port = request.ring_host.strip(), request.ring_port
        log.info("node %s registered as %s from %s; gpu decision: %s", name, node.node_id,
                 node.peer, request.decision.reason or "n/a")
        return pb.RegisterReply(
            node_id=node.node_id,
            run_id=self.orch.run_id,
            heartbeat_interval_s=self.registry.heartbeat_interval_s,
            max_update_bytes=self.max_update_bytes,
            chunk_size=self.orch.chunk_size,
        )

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
                        ) -> pb.HeartbeatReply:
        await self.auth.check(context)
        node = self.registry.get(request.node_id)
        if node is None:
            return pb.HeartbeatReply(known=False)
        await self.auth.bind(context, node.name, "heartbeat")
        self.registry.touch(node.node_id)
        node.state = request.state or node.state
        if request.HasField("decision"):
            node.decision = _as_dict(request.decision)
        return pb.HeartbeatReply(known=True, shutdown=self.orch.finished.is_set())

    async def PullTask(self, request: pb.PullTaskRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.TaskChunk]:
        await self.auth.check(context)
        node = await self._node(request.node_id, context)
        wait_s = min(max(request.wait_s, 0), MAX_POLL_S)
        task = self.orch.task_for(node)
        if task is None and not self.orch.finished.is_set() and wait_s:
            node.wakeup.clear()
            try:
                await asyncio.wait_for(node.wakeup.wait(), timeout=wait_s)
            except TimeoutError:
                pass
            self.registry.touch(node.node_id)
            task = self.orch.task_for(node)
        if task is None:
            if self.orch.finished.is_set():
                node.state = "shutdown"
                yield pb.TaskChunk(header=pb.TaskHeader(
                    kind=pb.TASK_KIND_SHUTDOWN, message=f"run {self.orch.state}"))
            else:
                yield pb.TaskChunk(header=pb.TaskHeader(kind=pb.TASK_KIND_NONE))
            return
        yield pb.TaskChunk(header=task.header)
        for chunk in task.chunks:
            yield pb.TaskChunk(data=chunk)

    async def PushUpdate(self, request_iterator: AsyncIterator[pb.UpdateChunk],
                         context: grpc.aio.ServicerContext) -> pb.PushReply:
        await self.auth.check(context)
        try:
            first = await anext(aiter(request_iterator))
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty update stream")
        if not first.HasField("header"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "an update stream must start with its header")
        header = first.header
        if self.registry.get(header.node_id) is None:
            # Counted like any other rejection, so probing with made-up ids shows in status.
            self.orch.reject(None, header, UpdateRejected(
                Reject.UNKNOWN_NODE, f"unknown node id {header.node_id!r}"))
        node = await self._node(header.node_id, context)
        rnd = None
        try:
            rnd = self.orch.check_update(node, header)
            if header.failed:
                self.orch.record_failure(node, header, rnd)
                return pb.PushReply(accepted=True, message="failure recorded")
            tensors = None
            size = header.payload_size
            if header.kind == pb.TASK_KIND_EVALUATE:
                async for _ in request_iterator:
                    raise UpdateRejected(Reject.MALFORMED,
                                         "an evaluation result carries no weights")
            else:
                async with self._uploads:
                    t0 = time.perf_counter()
                    buf = await self._receive(header, request_iterator)
                    rnd.upload_s[node.node_id] = round(time.perf_counter() - t0, 4)
                    spec = self.orch.global_spec if header.kind == pb.TASK_KIND_TRAIN else None
                    tensors = await asyncio.to_thread(decode_and_check, buf, spec)
            await self.orch.accept(node, header, rnd, tensors, size)
        except UpdateRejected as exc:
            self.orch.reject(node, header, exc, rnd)
            code = STATUS_OF.get(exc.reason, grpc.StatusCode.INVALID_ARGUMENT)
            await context.abort(code, f"update rejected ({exc.reason}): {exc.message}")
        return pb.PushReply(accepted=True, message=f"update for round {header.round} accepted")

    async def _receive(self, header: pb.UpdateHeader,
                       chunks: AsyncIterator[pb.UpdateChunk]) -> bytearray:
        try:
            asm = codec.Assembler(header.payload_size, header.payload_sha256,
                                  self.max_update_bytes)
            async for msg in chunks:
                if msg.HasField("header"):
                    raise UpdateRejected(Reject.MALFORMED, "a second header inside the stream")
                asm.add(msg.data)
            return asm.finish()
        except codec.CodecError as exc:
            # The codec says which defect it was (too_large, digest, truncated, malformed).
            raise UpdateRejected(Reject(exc.reason), str(exc)) from None
