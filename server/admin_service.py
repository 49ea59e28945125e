"""The `fedgpu.v1.Admin` service: what operators ask and do (`fedgpu nodes|status|rounds`,
`fedgpu job ...`, `fedgpu users ...`). Every call needs an operator credential and passes the
guard (server/admin_guard.py), which admits the caller by their role (server/permissions.py)
and writes the call to the audit log; the documents come from server/views/documents.py, the
one producer the dashboard reads too."""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc

from fedgpu.core import audit, jsondoc
from fedgpu.core.bundles import BundleError
from fedgpu.core.errors import FedgpuError
from fedgpu.core.job import MAX_JOB_FILE_BYTES
from fedgpu.core.people import PersonRole
from fedgpu.proto import admin_pb2, admin_pb2_grpc
from fedgpu.server import permissions
from fedgpu.server.admin_guard import bounded, guarded, outcome_of, status_of
from fedgpu.server.auth import Auth, Caller
from fedgpu.server.jobs import estimate
from fedgpu.server.jobs.queue import JobError, JobManager
from fedgpu.server.lifecycle import Lifecycle
from fedgpu.server.people import People, PeopleError
from fedgpu.server.registry import NotForgotten
from fedgpu.server.study_calls import StudyCalls
from fedgpu.server.views import documents as docs
from fedgpu.server.views import paging

# Model bytes per DownloadModel message, well under gRPC's 4 MiB message limit.
MODEL_CHUNK = 1 << 20
# Audit records per GetAudit page: each is at most a few KiB, so a page fits a message.
AUDIT_PAGE = 500
# How often `job logs --follow` looks for new events.
FOLLOW_POLL_S = 0.5


# The caller of the call being handled (set by `admit`, which the guard runs first), and what
# the handler adds to its audit record (the job a submission made, the model's digest).
_CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("caller", default=None)
_NOTE: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("note",
                                                                              default=None)


def _note(**fields: str) -> None:
    note = _NOTE.get()
    if note is not None:
        note.update(fields)


def _reply(doc: Any) -> admin_pb2.JsonReply:
    # Strict JSON: a NaN in a metric must not make the document unreadable to parsers.
    return admin_pb2.JsonReply(json=jsondoc.dumps(doc))


def _who(caller: Caller) -> str:
    if caller.person is not None and not caller.person.implicit:
        return f"user {caller.person.name} ({caller.person.role})"
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


def _target(request: Any) -> str:
    for key in ("job_id", "name"):
        value = getattr(request, key, None)
        if isinstance(value, str) and value:
            return value
    return ""


def _unidentified(context: grpc.aio.ServicerContext) -> str:
    """A refused caller as far as known: the name its certificate claims, and its address."""
    names = (context.auth_context() or {}).get("x509_common_name", ())
    claimed = b"".join(names).decode(errors="replace")[:64]
    return f"unidentified {context.peer()}" + (f" (certificate of {claimed})" if claimed else "")


class AdminService(StudyCalls, admin_pb2_grpc.AdminServicer):
    def __init__(self, jobs: JobManager, auth: Auth, lifecycle: Lifecycle | None = None,
                 dashboard: dict[str, Any] | None = None) -> None:
        self.jobs = jobs
        self.auth = auth
        self.lifecycle = lifecycle or Lifecycle()
        # Where the dashboard listens ({"host", "port"}; None: off): `fedgpu ui` asks.
        self.dashboard = dashboard

    # ---- the guard's two hooks: who may call, and the record of the call ----------------

    async def admit(self, call: str, request: Any, context: grpc.aio.ServicerContext) -> None:
        """Identify the caller and refuse (PERMISSION_DENIED) what their role may not do."""
        _CALLER.set(None)
        _NOTE.set({})
        caller = await self.auth.operator(context, nodes_may_ask=call == "ListNodes")
        _CALLER.set(caller)
        person = caller.person
        if person is None:  # a node's certificate, asking about itself
            return
        row = None
        if call in permissions.JOB_READS | permissions.JOB_ACTS and call != "ListJobs":
            row = self._job_or_none(getattr(request, "job_id", ""))
        why = permissions.refusal(person, call, permissions.job_study(row),
                                  has_job=row is not None and call != "SubmitJob")
        if why is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    def _job_or_none(self, job_id: str) -> Any:
        """The stored job a call is about (the current or latest one for ""), or None."""
        if not job_id:
            held = self.jobs.active or self.jobs.last
            if held is not None:
                return held.row
            rows = self.jobs.store.jobs(limit=1)
            return rows[0] if rows else None
        try:
            return self.jobs.get(job_id)
        except JobError:
            return None

    async def audit(self, call: str, request: Any, context: grpc.aio.ServicerContext) -> None:
        """Write the call and how it ended, as it ends (a success before its answer leaves; a
        refusal a moment after, as grpc's abort sends the status at once). The write (an
        fsync) runs off the event loop."""
        caller = _CALLER.get()
        note = _NOTE.get() or {}
        outcome, message = outcome_of(context)
        actor = caller.actor if caller is not None else _unidentified(context)
        await asyncio.to_thread(self.auth.audit, actor, f"Admin.{call}",
                                note.get("target") or _target(request), outcome,
                                note.get("detail") or message)

    async def _may_submit(self, caller: Caller, job: Any,
                          context: grpc.aio.ServicerContext) -> None:
        """A researcher's job must name one of their studies (known once it is parsed)."""
        study = permissions.job_study(job)
        self._refuse_unknown_studies([study] if study else [])
        if caller.person is None:
            return
        why = permissions.refusal(caller.person, "SubmitJob", study)
        if why is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    def _noted(self, **fields: str) -> None:
        _note(**fields)

    def _caller(self) -> Caller:
        caller = _CALLER.get()
        assert caller is not None, "admit runs before every handler"
        return caller

    async def _fail(self, context: grpc.aio.ServicerContext, exc: Exception) -> None:
        await context.abort(*status_of(exc))

    # ---- the federation and its runs -----------------------------------------------

    @guarded
    async def GetStatus(self, request: admin_pb2.GetStatusRequest,
                        context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        try:
            return _reply({**docs.status_of(self.jobs, request.job_id),
                           "dashboard": self.dashboard})
        except JobError as exc:
            await self._fail(context, exc)
            raise

    @guarded
    async def ListRounds(self, request: admin_pb2.ListRoundsRequest,
                         context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
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
        caller = self._caller()
        # A node's certificate learns about itself only, never about the other sites.
        only = None if caller.role == "operator" else caller.names
        nodes = docs.nodes_doc(self.jobs.registry, only)["nodes"]
        return admin_pb2.JsonReply(json=paging.page({}, "nodes", nodes, request.offset))

    # ---- jobs ----------------------------------------------------------------------------

    @guarded
    async def SubmitJob(self, request_iterator: AsyncIterator[admin_pb2.SubmitJobChunk],
                        context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        caller = self._caller()
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
        try:
            got = await jobs.intake.receive(
                head, request_iterator, _who(caller),
                admit=lambda job: self._may_submit(caller, job, context))
        except BundleError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                bounded(f"task bundle refused: {exc}"))
            raise
        row, job = got.row, got.job
        doc = docs.job_summary(jobs, row)
        if got.warnings:
            # The job is queued; its submitter hears now what would hold it (`job submit`
            # prints these on stderr).
            doc["warnings"] = got.warnings
        _note(target=row.job_id,
              detail=f"job {row.name!r} study {permissions.job_study(job) or '-'}")
        # Off the critical path of the queue: a rough training time from the sites' speed.
        doc["estimate"] = est = estimate.estimate(job, jobs.registry.alive())
        if est is not None:
            jobs.store.add_event(row.job_id, f"estimated {est['text']}")
        return _reply(doc)

    @guarded
    async def ListJobs(self, request: admin_pb2.ListJobsRequest,
                       context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        person = self._caller().person
        doc = docs.jobs_doc(self.jobs)
        if person is not None and person.role == "researcher":
            # Only the jobs of their own studies.
            theirs = {r.job_id for r in self.jobs.store.jobs()
                      if permissions.may_read_job(person, permissions.job_study(r))}
            doc = [j for j in doc if j.get("job_id") in theirs]
        return _reply(doc)

    @guarded
    async def GetJob(self, request: admin_pb2.GetJobRequest,
                     context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        try:
            return _reply(docs.job_doc(self.jobs, request.job_id))
        except JobError as exc:
            await self._fail(context, exc)
            raise

    @guarded
    async def StopJob(self, request: admin_pb2.StopJobRequest,
                      context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        try:
            row = self.jobs.stop(request.job_id)
        except JobError as exc:
            await self._fail(context, exc)
            raise
        return _reply(docs.job_summary(self.jobs, row))

    @guarded
    async def ForgetNode(self, request: admin_pb2.ForgetNodeRequest,
                         context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
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
        # Answered first, then stopped: the reply must get out before the port closes.
        retire = ("retired by the operator ('fedgpu server stop --retire-nodes')"
                  if request.retire_nodes else "")
        asyncio.get_running_loop().call_later(0.2, self.lifecycle.request_stop, retire)
        return _reply({"stopping": True, "retire_nodes": request.retire_nodes})

    @guarded
    async def JobLogs(self, request: admin_pb2.JobLogsRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[admin_pb2.JsonReply]:
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
        try:
            path = self.jobs.model_file(request.job_id)
        except JobError as exc:
            await self._fail(context, exc)
            raise
        # The checkpointer replaces the file by renaming, so the open file stays one
        # consistent model while a newer one is written.
        with open(path, "rb") as fh:
            size, digest = await asyncio.to_thread(_digest, fh)
            _note(detail=f"{size} bytes, sha256 {digest}")
            fh.seek(0)
            yield admin_pb2.ModelChunk(header=admin_pb2.ModelHeader(
                job_id=request.job_id, round=_model_round(fh), size=size, sha256=digest))
            fh.seek(0)
            while chunk := await asyncio.to_thread(fh.read, MODEL_CHUNK):
                yield admin_pb2.ModelChunk(data=chunk)

    # ---- people (admins only: the guard refuses everyone else) ------------------------

    def _people(self) -> People:
        if self.auth.people is None:
            raise FedgpuError("this aggregator keeps no table of people")
        return self.auth.people

    @guarded
    async def AddUser(self, request: admin_pb2.AddUserRequest,
                      context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        try:
            role = PersonRole(request.role)
        except ValueError:
            raise FedgpuError(f"role {request.role[:40]!r} is none of "
                              f"{', '.join(PersonRole)}") from None
        self._refuse_unknown_studies(list(request.studies))
        person, token = self._people().add(
            request.name, role, list(request.studies), by=self._caller().actor,
            cert_sha256=request.cert_sha256 or None)
        _note(detail=f"role {person.role}, studies {','.join(person.studies) or '-'}, "
              f"{person.credential}")
        return _reply({"user": person.to_dict(), "token": token})

    @guarded
    async def ListUsers(self, request: admin_pb2.ListUsersRequest,
                        context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        return _reply({"users": [p.to_dict() for p in self._people().all()]})

    @guarded
    async def RevokeUser(self, request: admin_pb2.RevokeUserRequest,
                         context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        try:
            person = self._people().revoke(request.name)
        except PeopleError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND if "no user" in str(exc)
                                else grpc.StatusCode.FAILED_PRECONDITION, bounded(str(exc)))
            raise
        return _reply({"user": person.to_dict()})

    @guarded
    async def GetAudit(self, request: admin_pb2.GetAuditRequest,
                       context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        log_ = self.auth.audit_log
        if log_ is None:
            raise FedgpuError("this aggregator keeps no audit log")
        limit = request.limit if 0 < request.limit <= AUDIT_PAGE else AUDIT_PAGE
        doc = await asyncio.to_thread(audit.page, log_.path, request.after_seq, limit,
                                      request.verify)
        return _reply(doc)


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
