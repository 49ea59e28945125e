"""People and roles against a real aggregator on loopback: every role against every Admin
call, revocation (at once and after a restart), the audit log naming each caller, and the
dashboard showing each person what their role allows.

Threat model: a person who holds a valid credential of a lesser role (a viewer, a researcher
of another study) and tries calls their role does not allow, or a revoked person who tries
their old token. Each must get PERMISSION_DENIED (or UNAUTHENTICATED) and the refusal must be
on the audit record under their name. Not covered: someone who holds an admin's token.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from fedgpu.core import admin_client, audit
from fedgpu.core.transport import token_metadata
from fedgpu.proto import admin_pb2, admin_pb2_grpc
from tests.fixtures.federation import OPERATOR_TOKEN, Federation, cli, free_port, write_job

DENIED = {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED}
A, D = "allowed", "denied"
ONCO_JOB, BARE_JOB = "aaaaaaaaaaaa", "bbbbbbbbbbbb"


def _seed(state: Path) -> None:
    """Two ended jobs in the real job store: one of study onco (as the job file's `study`
    key will store it), one naming no study."""
    from fedgpu.core.constants import JobState
    from fedgpu.server.jobs.store import JobStore

    store = JobStore(state)
    for job_id, extra in ((ONCO_JOB, {"study": "onco"}), (BARE_JOB, {})):
        store.add_job(job_id=job_id, name=job_id, task="digits", job_toml="task='digits'\n",
                      job={"task": "digits", **extra}, source="submit", source_sha256="0",
                      submitted_by="seed", rounds=1, state_dir=f"jobs/{job_id}")
        store.update(job_id, state=JobState.FINISHED, finished_at=time.time())
        store.add_event(job_id, "seeded")
    store.close()


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    tmp = tmp_path_factory.mktemp("people")
    state = tmp / "state"
    _seed(state)
    federation = Federation(tmp)
    federation.ui_port = free_port()  # type: ignore[attr-defined]
    federation.state = state  # type: ignore[attr-defined]
    try:
        federation.start_server(None, "--state-dir", str(state), "--ui-port",
                                str(federation.ui_port))  # type: ignore[attr-defined]
        tokens = {"legacy": OPERATOR_TOKEN}
        for name, role, studies in (("ada", "admin", []), ("rob", "researcher", ["onco"]),
                                    ("vic", "viewer", [])):
            args = ["users", "add", name, "--role", role, "--address", federation.address,
                    "--json", *sum((["--study", s] for s in studies), [])]
            done = cli(*args)
            assert done.returncode == 0, done.stderr
            tokens[role] = json.loads(done.stdout)["token"]
        federation.tokens = tokens  # type: ignore[attr-defined]
        yield federation
    finally:
        federation.stop()


def _call(address: str, token: str, call: str, tmp: Path) -> grpc.StatusCode:
    """Make `call` as the holder of `token`; the status it ended with."""
    md = token_metadata(token)
    with grpc.insecure_channel(address) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        method, _, arg = call.partition(":")
        job = {"onco": ONCO_JOB, "bare": BARE_JOB}.get(arg, "")
        try:
            if method == "SubmitJob":
                toml = write_job(tmp / "job.toml", min_nodes=1).read_text()
                header = admin_pb2.SubmitJobHeader(job_toml=toml, filename="job.toml")
                stub.SubmitJob(iter([admin_pb2.SubmitJobChunk(header=header)]), metadata=md,
                               timeout=20)
            elif method == "JobLogs":
                list(stub.JobLogs(admin_pb2.JobLogsRequest(job_id=job), metadata=md,
                                  timeout=20))
            elif method == "DownloadModel":
                list(stub.DownloadModel(admin_pb2.DownloadModelRequest(job_id=job),
                                        metadata=md, timeout=20))
            else:
                fields: dict[str, Any] = {}
                if job:
                    fields["job_id"] = job
                if method in ("ForgetNode", "RevokeUser"):
                    fields["name"] = "nobody"
                if method in ("RemoveStudy", "EnrolSites", "WithdrawSites"):
                    fields["name"] = "nobody"  # admitted, then refused as unknown
                if method in ("EnrolSites", "WithdrawSites"):
                    fields["sites"] = ["site-x"]
                if method == "CreateStudy":
                    fields["name"] = f"s{time.monotonic_ns()}"
                if method == "AddUser":
                    fields.update(name=f"new-{time.monotonic_ns()}", role="viewer")
                request = admin_client._REQUESTS[method](**fields)
                getattr(stub, method)(request, metadata=md, timeout=20)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


# role -> expected, per call (":onco" a job of the researcher's study, ":bare" one of none).
TABLE = {
    #                         admin researcher viewer legacy
    "ListNodes":              (A, A, A, A),
    "GetStatus":              (A, D, A, A),  # the latest job: the bare one
    "GetStatus:onco":         (A, A, A, A),
    "ListRounds:onco":        (A, A, A, A),
    "ListRounds:bare":        (A, D, A, A),
    "ListJobs":               (A, A, A, A),
    "GetJob:onco":            (A, A, A, A),
    "GetJob:bare":            (A, D, A, A),
    "JobLogs:onco":           (A, A, A, A),
    "JobLogs:bare":           (A, D, A, A),
    "StopJob:onco":           (A, A, D, A),
    "StopJob:bare":           (A, D, D, A),
    "DownloadModel:onco":     (A, A, D, A),
    "DownloadModel:bare":     (A, D, D, A),
    "SubmitJob":              (A, D, D, A),  # the job names no study
    "ForgetNode":             (A, D, D, A),
    "AddUser":                (A, D, D, A),
    "ListUsers":              (A, D, D, A),
    "RevokeUser":             (A, D, D, A),
    "GetAudit":               (A, D, D, A),
    # Allowed, it would stop the shared aggregator: only the refusals are made here (an
    # operator's stop is tests/integration/test_restarts.py's).
    "StopServer":             (A, D, D, A),
    "CreateStudy":            (A, D, D, A),
    "EnrolSites":             (A, D, D, A),
    "WithdrawSites":          (A, D, D, A),
    "RemoveStudy":            (A, D, D, A),
    "ListStudies":            (A, A, A, A),
}
ROLES = ("admin", "researcher", "viewer", "legacy")


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("call", sorted(TABLE))
def test_each_role_against_each_call(fed: Federation, tmp_path: Path, call: str,
                                     role: str) -> None:
    expected = TABLE[call][ROLES.index(role)]
    if call == "StopServer" and expected == A:
        pytest.skip("allowed: it would stop the aggregator the other cases share")
    code = _call(fed.address, fed.tokens[role], call, tmp_path)  # type: ignore[attr-defined]
    got = D if code in DENIED else A
    assert got == expected, f"{role} {call}: {code}"


def test_every_admin_call_is_in_the_table() -> None:
    names = set(admin_pb2.DESCRIPTOR.services_by_name["Admin"].methods_by_name)
    assert names == {c.partition(":")[0] for c in TABLE}


def test_a_researcher_lists_only_their_studies_jobs(fed: Federation) -> None:
    tokens = fed.tokens  # type: ignore[attr-defined]
    mine = admin_client.query(fed.address, tokens["researcher"], "ListJobs")
    every = admin_client.query(fed.address, tokens["viewer"], "ListJobs")
    assert [j["job_id"] for j in mine] == [ONCO_JOB]
    assert {ONCO_JOB, BARE_JOB} <= {j["job_id"] for j in every}


def test_a_whole_job_id_a_researcher_does_not_list_gets_the_aggregators_reason(
        fed: Federation) -> None:
    """The CLI completes short ids from `job list`, which shows a researcher only their
    studies' jobs: a whole id it does not list goes to the aggregator, so a refusal says why
    instead of 'no job'. A short prefix still completes from the list alone."""
    rob = fed.tokens["researcher"]  # type: ignore[attr-defined]
    r = cli("job", "stop", BARE_JOB, "--address", fed.address, operator_token=rob)
    assert r.returncode == 1 and "rob (researcher): this job names no study" in r.stderr, \
        r.stderr
    r = cli("job", "stop", "cccccccccccc", "--address", fed.address, operator_token=rob)
    assert r.returncode != 0 and "no job 'cccccccccccc' on this aggregator" in r.stderr, \
        r.stderr
    r = cli("job", "stop", BARE_JOB[:4], "--address", fed.address, operator_token=rob)
    assert r.returncode == 2 and "no job id starts with it" in r.stderr, r.stderr


def test_the_audit_log_names_each_caller_and_outcome(fed: Federation, tmp_path: Path) -> None:
    tokens = fed.tokens  # type: ignore[attr-defined]
    _call(fed.address, tokens["viewer"], "StopJob:onco", tmp_path)
    _call(fed.address, tokens["researcher"], "GetJob:onco", tmp_path)
    _call(fed.address, "not-a-token", "ListJobs", tmp_path)
    path = fed.state / audit.AUDIT_FILE  # type: ignore[attr-defined]
    records = _records_until(path, lambda r: r["action"] == "Admin.ListJobs"
                             and r["outcome"] == "UNAUTHENTICATED")
    assert audit.verify(path).ok
    tail = records[-3:]
    assert (tail[0]["actor"], tail[0]["action"], tail[0]["target"], tail[0]["outcome"]) == \
        ("vic", "Admin.StopJob", ONCO_JOB, "PERMISSION_DENIED")
    assert (tail[1]["actor"], tail[1]["action"], tail[1]["outcome"]) == \
        ("rob", "Admin.GetJob", "OK")
    assert tail[2]["actor"].startswith("unidentified") and \
        tail[2]["outcome"] == "UNAUTHENTICATED"
    adds = [r for r in records if r["action"] == "Admin.AddUser" and r["outcome"] == "OK"]
    assert adds[0]["actor"] == "operator" and "role admin" in adds[0]["detail"]
    # The CLI reads the same file, or asks the aggregator and checks the chain itself.
    shown = cli("audit", "verify", "--state-dir", str(fed.state), "--json")  # type: ignore
    assert shown.returncode == 0 and json.loads(shown.stdout)["ok"]
    remote = cli("audit", "verify", "--address", fed.address, "--json")
    assert remote.returncode == 0, remote.stderr
    fetched = json.loads(remote.stdout)
    assert fetched["ok"] and fetched["records"] >= len(records)
    listed = cli("audit", "show", "--address", fed.address, "--json")
    assert [r["hash"] for r in json.loads(listed.stdout)][:len(records)] == \
        [r["hash"] for r in records]
    viewer = cli("audit", "show", "--address", fed.address,
                 operator_token=tokens["viewer"])
    assert viewer.returncode != 0 and "admins only" in viewer.stderr


def _records_until(path: Path, last: Any, timeout: float = 10) -> list[dict[str, Any]]:
    """The log's records once its last one matches `last`: a refused call's status leaves
    (grpc's abort sends it) a moment before the guard's record of it is on disk."""
    end = time.monotonic() + timeout
    while True:
        records = list(audit.read(path))
        if (records and last(records[-1])) or time.monotonic() > end:
            return records
        time.sleep(0.05)


def _http(fed: Federation, path: str, token: str) -> tuple[int, Any]:
    url = f"http://127.0.0.1:{fed.ui_port}{path}"  # type: ignore[attr-defined]
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_dashboard_serves_each_person_what_their_role_allows(fed: Federation) -> None:
    tokens = fed.tokens  # type: ignore[attr-defined]
    status, me = _http(fed, "/api/me", tokens["viewer"])
    assert status == 200 and me["role"] == "viewer" and me["name"] == "vic"
    assert not me["may"]["StopJob"] and me["may"]["GetJob"]
    status, me = _http(fed, "/api/me", tokens["researcher"])
    assert me["studies"] == ["onco"] and me["may"]["SubmitJob"] and not me["may"]["AddUser"]
    status, jobs = _http(fed, "/api/jobs", tokens["researcher"])
    assert status == 200 and [j["job_id"] for j in jobs] == [ONCO_JOB]
    status, _ = _http(fed, "/api/jobs", tokens["viewer"])
    assert status == 200
    # The status of the latest job (the bare one) is not a researcher's to read.
    status, doc = _http(fed, "/api/status", tokens["researcher"])
    assert status == 403 and "study" in doc["error"]
    status, _ = _http(fed, "/api/status", "nobody's token")
    assert status == 401
    # Written off the event loop (not waited for): look until it is there.
    path = fed.state / audit.AUDIT_FILE  # type: ignore[attr-defined]

    def seen() -> tuple[bool, bool]:
        records = list(audit.read(path))
        return (any(r["actor"] == "vic" and r["action"] == "dashboard /api/me"
                    for r in records),
                any(r["actor"] == "rob" and r["action"] == "dashboard /api/status"
                    and r["outcome"] == "PERMISSION_DENIED" for r in records))

    end = time.monotonic() + 10
    while seen() != (True, True):
        assert time.monotonic() < end, f"dashboard records missing: {seen()}"
        time.sleep(0.05)


def test_revocation_is_at_once_and_survives_a_restart(fed: Federation, tmp_path: Path) -> None:
    done = cli("users", "add", "tmp-viewer", "--role", "viewer", "--address", fed.address,
               "--json")
    token = json.loads(done.stdout)["token"]
    assert _call(fed.address, token, "ListJobs", tmp_path) == grpc.StatusCode.OK
    done = cli("users", "revoke", "tmp-viewer", "--address", fed.address)
    assert done.returncode == 0, done.stderr
    assert _call(fed.address, token, "ListJobs", tmp_path) == grpc.StatusCode.UNAUTHENTICATED
    assert _http(fed, "/api/jobs", token)[0] == 401
    fed.restart_server()
    assert _call(fed.address, token, "ListJobs", tmp_path) == grpc.StatusCode.UNAUTHENTICATED
    listed = json.loads(cli("users", "list", "--address", fed.address, "--json").stdout)
    assert {u["name"]: u["revoked"] for u in listed["users"]}["tmp-viewer"] is True
    # The others' tokens still work after the restart.
    assert _call(fed.address, fed.tokens["viewer"], "ListJobs",  # type: ignore[attr-defined]
                 tmp_path) == grpc.StatusCode.OK
