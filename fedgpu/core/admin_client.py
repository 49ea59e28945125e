"""Ask a running aggregator: the Admin service and the standard health service."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedgpu.core import tls_diagnosis
from fedgpu.core.errors import FedgpuError
from fedgpu.core.jsondoc import COUNT_KEY
from fedgpu.core.tls import TlsFiles
from fedgpu.core.transport import channel, token_metadata
from fedgpu.proto import admin_pb2, admin_pb2_grpc

_REQUESTS = {
    "GetStatus": admin_pb2.GetStatusRequest,
    "ListNodes": admin_pb2.ListNodesRequest,
    "ListRounds": admin_pb2.ListRoundsRequest,
    "ListJobs": admin_pb2.ListJobsRequest,
    "GetJob": admin_pb2.GetJobRequest,
    "StopJob": admin_pb2.StopJobRequest,
    "ForgetNode": admin_pb2.ForgetNodeRequest,
    "AddUser": admin_pb2.AddUserRequest,
    "ListUsers": admin_pb2.ListUsersRequest,
    "RevokeUser": admin_pb2.RevokeUserRequest,
    "GetAudit": admin_pb2.GetAuditRequest,
    "StopServer": admin_pb2.StopServerRequest,
    "CreateStudy": admin_pb2.CreateStudyRequest,
    "EnrolSites": admin_pb2.EnrolSitesRequest,
    "WithdrawSites": admin_pb2.EnrolSitesRequest,
    "RemoveStudy": admin_pb2.CreateStudyRequest,
    "ListStudies": admin_pb2.ListStudiesRequest,
}
# Bundle bytes per SubmitJob message, well under gRPC's 4 MiB message limit.
SUBMIT_CHUNK = 1 << 20


def _explain(address: str, exc: grpc.RpcError, tls: TlsFiles | None = None) -> FedgpuError:
    code = exc.code()
    if tls_diagnosis.worth_probing(exc):
        why = tls_diagnosis.diagnose(address, tls)
        if why is not None:
            return FedgpuError(str(why))
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return FedgpuError(
            f"cannot reach aggregator at {address} — is it running? Give its address "
            "(--address HOST:PORT) or a saved connection (--connection NAME; 'fedgpu "
            "connection list' shows them)")
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        why = _node_certificate(address, tls)
        if why is not None:
            return FedgpuError(why)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return FedgpuError(f"aggregator at {address}: {exc.details()}")
    return FedgpuError(f"aggregator at {address} answered {code.name}: {exc.details()}")


def _node_certificate(address: str, tls: TlsFiles | None) -> str | None:
    """A refusal explained by our certificate: a node's, on a call for operators (the
    aggregator then checks the node token, and would suggest FEDGPU_TOKEN)."""
    if tls is None or tls.cert is None:
        return None
    from fedgpu.core import certs

    try:
        pem = tls.cert.read_bytes()
        role, name = certs.role(pem), certs.identity(pem)
    except (OSError, ValueError):
        return None
    if role is not None and role is not certs.Role.NODE:
        return None
    return (f"aggregator at {address}: {tls.cert} is a node certificate (node {name!r}); this "
            "command needs the operator credential, an operator certificate: 'fedgpu certs "
            "operator NAME --dir DIR' issues one (and saves a connection with it)")


# The list documents come in pages (each fits a gRPC message); query() joins them.
_PAGED = {"ListNodes": "nodes", "ListRounds": "rounds"}


def query(address: str, token: str | None, method: str, timeout: float = 10,
          tls: TlsFiles | None = None, **fields: Any) -> Any:
    """The method's whole document (every page of a list); `fields` fill its request (e.g.
    job_id)."""
    with channel(address, tls) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)

        def ask(**more: int) -> Any:
            try:
                reply = getattr(stub, method)(
                    _REQUESTS[method](**fields, **more), metadata=token_metadata(token),
                    timeout=timeout)
            except grpc.RpcError as exc:
                raise _explain(address, exc, tls) from None
            return json.loads(reply.json)

        doc = ask()
        key = _PAGED.get(method)
        while key is not None and isinstance(doc, dict) and doc.get("next_offset") is not None:
            more = ask(offset=int(doc.pop("next_offset")))
            doc[key].extend(more[key])
            doc["next_offset"] = more.get("next_offset")
            if more.get(COUNT_KEY):
                doc[COUNT_KEY] = doc.get(COUNT_KEY, 0) + more[COUNT_KEY]
        if isinstance(doc, dict):
            doc.pop("next_offset", None)
    return doc


def submit_job(address: str, token: str | None, job_toml: str, filename: str,
               bundle: bytes | None = None, timeout: float = 120,
               tls: TlsFiles | None = None, weights: Path | None = None) -> dict[str, Any]:
    """Queue a job (and its packed task bundle, and its initial weights file: the aggregator
    reads no path a job names); the reply names the job id."""
    header = admin_pb2.SubmitJobHeader(job_toml=job_toml, filename=filename)
    if bundle is not None:
        header.bundle_size = len(bundle)
        header.bundle_sha256 = hashlib.sha256(bundle).hexdigest()
    if weights is not None:
        header.initial_weights_size, header.initial_weights_sha256 = _file_digest(weights)
        # A whole model may take long to send: the deadline grows with it (>= 10 MB/s).
        timeout += header.initial_weights_size / 10e6

    def messages() -> Iterator[admin_pb2.SubmitJobChunk]:
        yield admin_pb2.SubmitJobChunk(header=header)
        view = memoryview(bundle or b"")
        for start in range(0, len(view), SUBMIT_CHUNK):
            yield admin_pb2.SubmitJobChunk(data=bytes(view[start:start + SUBMIT_CHUNK]))
        if weights is not None:
            sent = 0
            with open(weights, "rb") as fh:
                while sent < header.initial_weights_size and (
                        block := fh.read(min(SUBMIT_CHUNK, header.initial_weights_size - sent))):
                    sent += len(block)
                    yield admin_pb2.SubmitJobChunk(data=block)

    with channel(address, tls) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        try:
            reply = stub.SubmitJob(messages(), metadata=token_metadata(token), timeout=timeout)
        except grpc.RpcError as exc:
            raise _explain(address, exc, tls) from None
    return json.loads(reply.json)


def _file_digest(path: Path) -> tuple[int, str]:
    """(size, sha256) of a regular file; FedgpuError naming it otherwise."""
    digest = hashlib.sha256()
    size = 0
    try:
        with open(path, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise FedgpuError(f"initial_weights {path} is not a regular file")
            while block := fh.read(SUBMIT_CHUNK):
                digest.update(block)
                size += len(block)
    except OSError as exc:
        raise FedgpuError(f"cannot read initial_weights {path}: {exc.strerror}") from None
    return size, digest.hexdigest()


def job_logs(address: str, token: str | None, job_id: str, follow: bool = False,
             after: int = 0, tls: TlsFiles | None = None) -> Iterator[dict[str, Any]]:
    """The job's events as they come; with `follow`, until the job ends."""
    with channel(address, tls) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        request = admin_pb2.JobLogsRequest(job_id=job_id, follow=follow, after_seq=after)
        # Following has no deadline of its own: the server ends the stream with the job.
        call = stub.JobLogs(request, metadata=token_metadata(token),
                            timeout=None if follow else 60)
        try:
            for reply in call:
                yield json.loads(reply.json)
        except grpc.RpcError as exc:
            raise _explain(address, exc, tls) from None
        finally:
            call.cancel()


def download_model(address: str, token: str | None, job_id: str, out: Path,
                   timeout: float = 3600, tls: TlsFiles | None = None) -> dict[str, Any]:
    """Stream the job's latest global model into `out` (written to a temporary name, its
    sha256 checked, then renamed): a partial file never carries the final name."""
    tmp = out.with_name(f".{out.name}.part")
    with channel(address, tls) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        try:
            stream = stub.DownloadModel(admin_pb2.DownloadModelRequest(job_id=job_id),
                                        metadata=token_metadata(token), timeout=timeout)
            first = next(stream, None)
            if first is None or not first.HasField("header"):
                raise FedgpuError(f"aggregator at {address} sent no model header")
            head = first.header
            digest = hashlib.sha256()
            size = 0
            with open(tmp, "wb") as fh:
                for msg in stream:
                    digest.update(msg.data)
                    size += len(msg.data)
                    if size > head.size:
                        raise FedgpuError("the model stream is longer than announced")
                    fh.write(msg.data)
        except grpc.RpcError as exc:
            tmp.unlink(missing_ok=True)
            raise _explain(address, exc, tls) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    if size != head.size or digest.hexdigest() != head.sha256:
        tmp.unlink(missing_ok=True)
        raise FedgpuError(f"the model of job {job_id} arrived damaged ({size} of {head.size} "
                          "bytes, or a digest mismatch); try again")
    os.replace(tmp, out)
    return {"job_id": head.job_id, "round": head.round, "size": head.size,
            "sha256": head.sha256, "path": str(out)}


def health(address: str, service: str = "", timeout: float = 5,
           tls: TlsFiles | None = None) -> str:
    """The health status name (SERVING, NOT_SERVING, ...) as a plain gRPC client sees it."""
    with channel(address, tls) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            raise _explain(address, exc, tls) from None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
