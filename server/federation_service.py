"""The `fedgpu.v1.Federation` service: thin gRPC glue over the registry and the running
job's round engine. Nodes register once with the federation and stay across jobs (what a
registration and a heartbeat report is taken in server/registration.py).

With a bulk port, the weights themselves may move beside gRPC (server/transfer/bulk_server.py): a
PullTask asked with `bulk` carries a download ticket instead of chunks, and OpenUpload checks
an update's header and hands out an upload ticket."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable

import grpc

from fedgpu.core import slots
from fedgpu.core.bulk import Direction
from fedgpu.core.bundles import BundleError
from fedgpu.core.constants import TaskApproval, Transport
from fedgpu.proto import pb, pb_grpc
from fedgpu.server import registration
from fedgpu.server.auth import Auth
from fedgpu.server.jobs import log_context
from fedgpu.server.jobs.queue import JobError, JobManager
from fedgpu.server.lifecycle import Lifecycle
from fedgpu.server.registry import Node, Registry
from fedgpu.server.rejections import STATUS_OF, Reject, UpdateRejected
from fedgpu.server.rounds.attempt import RoundState
from fedgpu.server.rounds.engine import Orchestrator
from fedgpu.server.rounds.receive import accepted_message, check_header, ingest
from fedgpu.server.rounds.takeover import digest_of
from fedgpu.server.transfer import wire_limits
from fedgpu.server.transfer.bulk_server import ReceiveBy
from fedgpu.server.transfer.payload import ModelPayload
from fedgpu.server.transfer.tickets import TicketBook
from fedgpu.server.transfer.uploads import Received, Uploads
from fedgpu.server.transfer.wire_limits import shown

log = logging.getLogger("fedgpu.server.federation")

MAX_POLL_S = 30
# A long poll ends after this share of the time the node asked for, drawn at random: after a
# restart thousands of sites poll at once, and must not all come back in the same second
# forever after.
POLL_JITTER = (0.6, 1.0)


class FederationService(pb_grpc.FederationServicer):
    def __init__(
        self,
        registry: Registry,
        jobs: JobManager,
        auth: Auth,
        uploads: Uploads,
        federation_id: str,
        tickets: TicketBook | None = None,
        bulk_port: int = 0,
        lifecycle: Lifecycle | None = None,
    ) -> None:
        self.registry = registry
        self.jobs = jobs
        self.auth = auth
        self.federation_id = federation_id
        # Receives payloads within a memory budget, with idle and round deadlines: aggregator
        # memory stays O(budget), never O(model x nodes), and no silent sender holds it.
        self.uploads = uploads
        self.max_update_bytes = uploads.max_update_bytes
        # The bulk port and its tickets; None / 0 when the weights move over gRPC only.
        self.tickets = tickets
        self.bulk_port = bulk_port if tickets is not None else 0
        self.lifecycle = lifecycle or Lifecycle()

    async def _node(self, node_id: str, context: grpc.aio.ServicerContext) -> Node:
        node = self.registry.get(node_id)
        if node is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"unknown node id {shown(node_id)}: register again (the aggregator may have "
                "restarted)",
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
        # An operator's credential is refused here: operators never train.
        await self.auth.node(context)
        node = await registration.register(self.registry, self.auth, request, context)
        return pb.RegisterReply(
            node_id=node.node_id,
            run_id=self.federation_id,
            heartbeat_interval_s=self.registry.heartbeat_interval_s,
            max_update_bytes=self.max_update_bytes,
            chunk_size=self.jobs.chunk_size,
            bulk_port=self.bulk_port,
            offers=self._offers_for(node),
        )

    def _offers_for(self, node: Node) -> list[pb.TaskBundle]:
        # A site that runs installed tasks only has nothing to say about bundles.
        if (node.task_approval or TaskApproval.INSTALLED) == TaskApproval.INSTALLED:
            return []
        return self.jobs.offers()

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
                        ) -> pb.HeartbeatReply:
        await self.auth.node(context)
        node = self.registry.get(request.node_id)
        if node is None:
            return pb.HeartbeatReply(known=False, bulk_port=self.bulk_port)
        await self.auth.bind(context, node.name, "heartbeat")
        await registration.heartbeat(self.registry, node, request, context)
        # A task no open round waits for (its job was stopped, its round closed): the node
        # kills its worker instead of training for an update that would be refused.
        abandon = bool(request.task_id) and not self.jobs.wants(node, request.task_id)
        # Its other slots' tasks, each answered the same way (bounded: one per slot).
        dropped = [t for t in request.more_task_ids[:slots.MAX_SLOTS]
                   if not self.jobs.wants(node, t)]
        offers = self._offers_for(node)
        # Only answers about bundles still offered are kept: the map stays bounded.
        offered = {o.sha256 for o in offers}
        node.bundle_states = {b.sha256: (b.state, b.reason) for b in request.bundles
                              if b.sha256 in offered}
        return pb.HeartbeatReply(known=True, shutdown=bool(self.lifecycle.retire),
                                 abandon=abandon, offers=offers,
                                 bulk_port=self.bulk_port, abandon_task_ids=dropped)

    async def FetchBundle(self, request: pb.FetchBundleRequest,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[pb.BundleChunk]:
        await self.auth.node(context)
        await self._node(request.node_id, context)
        try:
            header, data = self.jobs.bundle_for_node(request.sha256)
        except (JobError, BundleError) as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            raise
        yield pb.BundleChunk(header=header)
        step = self.jobs.chunk_size
        for start in range(0, len(data), step):
            yield pb.BundleChunk(data=data[start:start + step])

    async def PullTask(self, request: pb.PullTaskRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.TaskChunk]:
        await self.auth.node(context)
        node = await self._node(request.node_id, context)
        if self.bulk_port:
            # Why a node falls back to gRPC, as it tells us (`fedgpu nodes` bulk_error).
            node.bulk_error = wire_limits.truncate(request.bulk_error, 512) or None
        self.registry.link(node.name).report(request.down_bytes_per_s, request.up_bytes_per_s)
        wait_s = min(max(request.wait_s, 0), MAX_POLL_S) * random.uniform(*POLL_JITTER)
        # Tasks its other slots work on are not served again (bounded: one per slot).
        busy, only = frozenset(request.busy_task_ids[:slots.MAX_SLOTS]), request.only_task_id
        node.polling += 1
        node.loop_seen = time.time()
        try:
            task = None if self.lifecycle.retire else self.jobs.task_for(node, busy, only)
            if task is None and not self.jobs.exiting.is_set() and wait_s:
                node.wakeup.clear()
                try:
                    await asyncio.wait_for(node.wakeup.wait(), timeout=wait_s)
                except TimeoutError:
                    pass
                self.registry.touch(node.node_id)
                task = None if self.lifecycle.retire else self.jobs.task_for(node, busy, only)
        finally:
            node.polling -= 1
            node.loop_seen = time.time()
        if task is None:
            if self.lifecycle.retire:
                node.state = "shutdown"
                yield pb.TaskChunk(header=pb.TaskHeader(
                    kind=pb.TASK_KIND_SHUTDOWN, message=self.lifecycle.retire))
            elif self.jobs.exiting.is_set():
                # A stop is a restart: the node keeps its registration and polls again.
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    "the aggregator is stopping (a restart keeps this "
                                    "node's registration): poll again")
            else:
                # Why the last round left this site out (a slow link), for its log; "" if not.
                yield pb.TaskChunk(header=pb.TaskHeader(kind=pb.TASK_KIND_NONE,
                                                        message=node.left_out or ""))
            return
        if task.payload is not None and request.bulk and self.tickets is not None:
            ticket = self.tickets.issue(Direction.DOWNLOAD, node.node_id, node.name,
                                        task.task_id, task.payload.size)
            header = pb.TaskHeader()
            header.CopyFrom(task.header)
            header.bulk.CopyFrom(pb.BulkTicket(ticket=ticket.token, port=self.bulk_port,
                                               expires_in_s=self.tickets.ttl_s))
            yield pb.TaskChunk(header=header)
            return
        offset = 0
        if (task.payload is not None and request.resume_task_id == task.task_id
                and 0 < request.resume_offset <= task.payload.size):
            # The rest of a stream that broke: the node holds (and has hashed) the start.
            offset = request.resume_offset
            header = pb.TaskHeader()
            header.CopyFrom(task.header)
            header.payload_offset = offset
            yield pb.TaskChunk(header=header)
        else:
            yield pb.TaskChunk(header=task.header)
        if task.payload is not None:
            node.transport = Transport.GRPC
            with self.jobs.downloads.track(node.name, task.payload.size, offset) as sent:
                for chunk in task.payload.chunks(self.jobs.chunk_size, offset):
                    yield pb.TaskChunk(data=chunk)
                    sent.add(len(chunk))

    async def PushUpdate(self, request_iterator: AsyncIterator[pb.UpdateChunk],
                         context: grpc.aio.ServicerContext) -> pb.PushReply:
        await self.auth.node(context)
        stream = aiter(request_iterator)
        try:
            first = await self.uploads.next_message(stream, time.time() + self.uploads.idle_s)
        except UpdateRejected as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no header: {exc.message}")
        if first is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty update stream")
        assert first is not None
        if not first.HasField("header"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "an update stream must start with its header")
        header = first.header
        # One engine for the whole stream (the job whose round handed out this task), even
        # if the job ends while it uploads.
        orch = self.jobs.engine_for(header.node_id, header.task_id)
        log_context.about(orch.job_id)  # this stream's log lines are that job's
        node = await self._update_node(orch, header, context)

        @contextlib.asynccontextmanager
        async def receive(rnd: RoundState) -> AsyncIterator[Received | None]:
            if header.kind in (pb.TASK_KIND_EVALUATE, pb.TASK_KIND_STATISTICS):
                if await self.uploads.next_message(stream, rnd.deadline) is not None:
                    raise UpdateRejected(Reject.MALFORMED, "an evaluation result or a site's "
                                         "statistics carries no weights")
                yield None
                return
            async with self.uploads.receive(node.name, header, stream, rnd.deadline,
                                            grpc_resume_key(node, header)) as got:
                yield got

        try:
            message = await ingest(orch, node, header, receive, Transport.GRPC,
                                   quiet=lambda: self.uploads.quiet_for(node.name))
        except UpdateRejected as exc:
            await self._abort(context, exc)
        return pb.PushReply(accepted=True, message=message)

    async def UploadOffset(self, request: pb.UpdateHeader, context: grpc.aio.ServicerContext
                           ) -> pb.UploadOffsetReply:
        await self.auth.node(context)
        orch = self.jobs.engine_for(request.node_id, request.task_id)
        node = await self._update_node(orch, request, context)
        if orch.answers.holders.already_accepted(request):
            return pb.UploadOffsetReply(already_accepted=True,
                                        message=accepted_message(request, again=True))
        # The node's own stream still holding its slot ends (and parks what it received).
        await orch.answers.take_over(node, request)
        return pb.UploadOffsetReply(
            offset=self.uploads.parked_offset(grpc_resume_key(node, request)))

    async def OpenUpload(self, request: pb.UpdateHeader, context: grpc.aio.ServicerContext
                         ) -> pb.BulkTicket:
        await self.auth.node(context)
        if self.tickets is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this aggregator has no bulk port: use PushUpdate")
        assert self.tickets is not None
        orch = self.jobs.engine_for(request.node_id, request.task_id)
        node = await self._update_node(orch, request, context)
        if request.failed or request.payload_size <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "only an update with a "
                                "payload moves over the bulk port: use PushUpdate")
        if orch.answers.holders.already_accepted(request):
            # A retry whose acknowledgement was lost: acknowledged again, counted once.
            return pb.BulkTicket(already_accepted=True,
                                 message=accepted_message(request, again=True))
        # The node's own older upload still holding its slot gives way to this retry.
        await orch.answers.take_over(node, request)
        try:
            # The same checks PushUpdate makes at the header, now and again on arrival.
            check_header(orch, node, request)
            self.uploads.assembler(request)  # size limit and digest algorithm
        except UpdateRejected as exc:
            orch.answers.reject(node, request, exc)
            await self._abort(context, exc)
        ticket = self.tickets.issue(Direction.UPLOAD, node.node_id, node.name,
                                    request.task_id, request.payload_size, request)
        return pb.BulkTicket(ticket=ticket.token, port=self.bulk_port,
                             expires_in_s=self.tickets.ttl_s)

    # ---- what the bulk port asks (UpdateDesk, server/transfer/bulk_server.py) --------------

    def open_payload(self, node_id: str, task_id: str) -> ModelPayload | None:
        node = self.registry.get(node_id)
        # Its task `task_id` (a site with --slots may hold tasks of several jobs).
        task = self.jobs.task_for(node, only=task_id) if node is not None else None
        return task.payload if task is not None else None

    def downloaded(self, node_id: str) -> None:
        node = self.registry.get(node_id)
        if node is not None:
            node.transport = Transport.BULK

    async def take_update(self, node_id: str, header: pb.UpdateHeader,
                          receive: ReceiveBy, abort: Callable[[], None] | None = None,
                          told: Callable[[str], None] | None = None) -> str:
        orch = self.jobs.engine_for(node_id, header.task_id)
        log_context.about(orch.job_id)
        node = self.registry.get(node_id)
        if node is None:
            exc = UpdateRejected(Reject.UNKNOWN_NODE, "the node this ticket was issued to is "
                                 "no longer registered")
            orch.answers.reject(None, header, exc)
            raise exc
        return await ingest(orch, node, header, lambda rnd: receive(rnd.deadline),
                            Transport.BULK, abort, lambda: self.uploads.quiet_for(node.name),
                            told)

    async def _update_node(self, orch: Orchestrator, header: pb.UpdateHeader,
                           context: grpc.aio.ServicerContext) -> Node:
        if self.registry.get(header.node_id) is None:
            # Counted like any other rejection, so probing with made-up ids shows in status.
            orch.answers.reject(None, header, UpdateRejected(
                Reject.UNKNOWN_NODE, f"unknown node id {shown(header.node_id)}"))
        return await self._node(header.node_id, context)

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, exc: UpdateRejected) -> None:
        code = STATUS_OF.get(exc.reason, grpc.StatusCode.INVALID_ARGUMENT)
        await context.abort(code, f"update rejected ({exc.reason}): {exc.message}")


def grpc_resume_key(node: Node, header: pb.UpdateHeader) -> str:
    """What a broken PushUpdate is kept under: its node, task and payload digest, so only that
    node's retry of that same update continues it."""
    return f"grpc:{node.node_id}:{header.task_id}:{digest_of(header)}"
