"""The `fedgpu.v1.Admin` service: what operators ask and do (`fedgpu nodes|status|rounds`,
`fedgpu job ...`). Every call needs the operator credential; the documents come from
server/views/documents.py, the one producer the dashboard reads too."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc

from fedgpu.core import jsondoc
from fedgpu.core.bundles import BundleError
from fedgpu.core.config import MAX_JOB_FILE_BYTES
from fedgpu.proto import admin_pb2, admin_pb2_grpc
from fedgpu.server.admin_guard import bounded, guarded, status_of
from fedgpu.server.auth import Auth, Caller
from fedgpu.server.jobs import estimate, submission
from fedgpu.server.jobs.queue import JobError, JobManager
from fedgpu.server.lifecycle import Lifecycle
from fedgpu.server.registry import NotForgotten
from fedgpu.server.views import documents as docs
from fedgpu.server.views import paging

# Model bytes per DownloadModel message, well under gRPC's 4 MiB message limit.
MODEL_CHUNK = 1 << 20
# How often `job logs --follow` looks for new events.
FOLLOW_POLL_S = 0.5


def _reply(doc: Any) -> admin_pb2.JsonReply:
    # Strict JSON: a NaN in a metric must not make the document unreadable to parsers.
    return admin_pb2.JsonReply(json=jsondoc.dumps(doc))


def _who(caller: Caller) -> str:
    if caller.names:
        return "operator certificate " + ", ".join(sorted(caller.names))
    return "operator token"


def _digest(fh: Any) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    fh.seek(0)
    while chunk := fh.read(MODEL_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, jobs: JobManager, auth: Auth, lifecycle: Lifecycle | None = None
                 ) -> None:
        self.jobs = jobs
        self.auth = auth
        self.lifecycle = lifecycle or Lifecycle()

    async def _fail(self, context: grpc.aio.ServicerContext, exc: Exception) -> None:
        await context.abort(*status_of(exc))

    # ---- the federation and its runs -----------------------------------------------

    @guarded
    async def GetStatus(self, request: admin_pb2.GetStatusRequest,
                        context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        await self.auth.operator(context)
        try:
            return _reply(docs.status_of(self.jobs, request.job_id))
        except JobError as exc:
            await self._fail(context, exc)
            raise

    @guarded
    async def ListRounds(self, request: admin_pb2.ListRoundsRequest,
                         context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        await self.auth.operator(context)
        try:
            doc = docs.rounds_of(self.jobs, request.job_id)
        except JobError as exc:
            await self._fail(context, exc)
            raise
        # In pages that each fit one gRPC message; admin_client joins them.
        head = {k: v for k, v in doc.items() if k != "rounds"}
        return admin_pb2.JsonReply(json=paging.page(head, "rounds", doc["rounds"],
                                                    request.offset))

    @guarded
    async def ListNodes(self, request: admin_pb2.ListNodesRequest,
                        context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        caller = await self.auth.operator(context, nodes_may_ask=True)
        # A node's certificate learns about itself only, never about the other sites.
        only = None if caller.role == "operator" else caller.names
        nodes = docs.nodes_doc(self.jobs.registry, only)["nodes"]
        return admin_pb2.JsonReply(json=paging.page({}, "nodes", nodes, request.offset))

    # ---- jobs ----------------------------------------------------------------------------

    @guarded
    async def SubmitJob(self, request_iterator: AsyncIterator[admin_pb2.SubmitJobChunk],
                        context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        caller = await self.auth.operator(context)
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("header"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "a job submission starts with its header")
        assert first is not None
        head = first.header
        if len(head.job_toml.encode()) > MAX_JOB_FILE_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the job file is larger than {MAX_JOB_FILE_BYTES} bytes")
        jobs = self.jobs
        jobs.check_room()  # before a byte more is read
        try:
            got = await submission.receive(head, request_iterator, jobs.state_dir,
                                           jobs.max_initial_bytes)
        except BundleError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                bounded(f"task bundle refused: {exc}"))
            raise
        filename = (head.filename or "job.toml")[:256]
        weights = got.weights
        try:
            # Parsing (and a ring's mixing matrix) and copying weights run off the loop.
            job = await asyncio.to_thread(jobs.prepare, head.job_toml, filename, got.bundle)
            if weights is None and job.initial_weights is not None:
                weights = await asyncio.to_thread(jobs.weights_from_dir, job)
            row = jobs.enqueue(job, head.job_toml, filename, _who(caller), bundle=got.bundle,
                               weights=weights)
        except BaseException:
            if weights is not None:
                weights.unlink(missing_ok=True)
            raise
        doc = docs.job_summary(jobs, row)
        # Off the critical path of the queue: a rough training time from the sites' speed.
        doc["estimate"] = est = estimate.estimate(job, jobs.registry.alive())
        if est is not None:
            jobs.store.add_event(row.job_id, f"estimated {est['text']}")
        return _reply(doc)

    @guarded
    async def ListJobs(self, request: admin_pb2.ListJobsRequest,
                       context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        await self.auth.operator(context)
        return _reply(docs.jobs_doc(self.jobs))

    @guarded
    async def GetJob(self, request: admin_pb2.GetJobRequest,
                     context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        await self.auth.operator(context)
        try:
            return _reply(docs.job_doc(self.jobs, request.job_id))
        except JobError as exc:
            await self._fail(context, exc)
            raise

    @guarded
    async def StopJob(self, request: admin_pb2.StopJobRequest,
                      context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        await self.auth.operator(context)
        try:
            row = self.jobs.stop(request.job_id)
        except JobError as exc:
            await self._fail(context, exc)
            raise
        return _reply(docs.job_summary(self.jobs, row))

    @guarded
    async def ForgetNode(self, request: admin_pb2.ForgetNodeRequest,
                         context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        await self.auth.operator(context)
        name = request.name.strip()
        try:
            node = self.jobs.registry.forget(name, force=request.force)
        except NotForgotten as exc:
            code = (grpc.StatusCode.FAILED_PRECONDITION if "alive" in str(exc)
                    else grpc.StatusCode.NOT_FOUND)
            # The name as asked, cut: an operator's typo is echoed, not a megabyte of it.
            await context.abort(code, str(exc)[:500])
            raise
        return _reply({"forgotten": node.name, "node_id": node.node_id})

    @guarded
    async def StopServer(self, request: admin_pb2.StopServerRequest,
                         context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        await self.auth.operator(context)
        # Answered first, then stopped: the reply must get out before the port closes.
        retire = ("retired by the operator ('fedgpu server stop --retire-nodes')"
                  if request.retire_nodes else "")
        asyncio.get_running_loop().call_later(0.2, self.lifecycle.request_stop, retire)
        return _reply({"stopping": True, "retire_nodes": request.retire_nodes})

    @guarded
    async def JobLogs(self, request: admin_pb2.JobLogsRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[admin_pb2.JsonReply]:
        await self.auth.operator(context)
        try:
            self.jobs.get(request.job_id)
        except JobError as exc:
            await self._fail(context, exc)
        after = max(0, request.after_seq)
        while True:
            events = self.jobs.store.events(request.job_id, after)
            for event in events:
                after = event.seq
                yield _reply(event.to_dict())
            if events:
                continue
            if not request.follow or self.jobs.get(request.job_id).ended:
                return
            await asyncio.sleep(FOLLOW_POLL_S)

    @guarded
    async def DownloadModel(self, request: admin_pb2.DownloadModelRequest,
                            context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[admin_pb2.ModelChunk]:
        await self.auth.operator(context)
        try:
            path = self.jobs.model_file(request.job_id)
        except JobError as exc:
            await self._fail(context, exc)
            raise
        # The checkpointer replaces the file by renaming, so the open file stays one
        # consistent model while a newer one is written.
        with open(path, "rb") as fh:
            size, digest = await asyncio.to_thread(_digest, fh)
            fh.seek(0)
            yield admin_pb2.ModelChunk(header=admin_pb2.ModelHeader(
                job_id=request.job_id, round=_model_round(fh), size=size, sha256=digest))
            fh.seek(0)
            while chunk := await asyncio.to_thread(fh.read, MODEL_CHUNK):
                yield admin_pb2.ModelChunk(data=chunk)


def _model_round(fh: Any) -> int:
    """The round a checkpoint file is of, from its safetensors metadata (0 when absent)."""
    import struct

    head = fh.read(8)
    if len(head) < 8:
        return 0
    (length,) = struct.unpack("<Q", head)
    try:
        meta = json.loads(fh.read(min(length, 1 << 20))).get("__metadata__") or {}
        return int(meta.get("global_round", 0))
    except (ValueError, AttributeError):
        return 0
