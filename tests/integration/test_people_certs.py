"""People with certificates under mutual TLS, on a real aggregator: the person made their own
key (`certs request`), the CA signed the request (`certs sign`), an admin pinned the
certificate (`users add --cert`). The table decides the role, never the certificate; another
certificate with the same name is refused; revoking refuses the pinned one at once.

Threat model: someone who gets the CA to sign a second certificate for a person's name (or
holds a revoked person's certificate) tries to act as them.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from fedgpu.core import audit, certs, csr
from fedgpu.core.tls import TlsFiles, channel_credentials
from fedgpu.proto import admin_pb2, admin_pb2_grpc
from tests.fixtures.federation import Federation, cli
from tests.integration.test_people import _records_until


def _flags(t: TlsFiles) -> list[str]:
    return ["--tls-cert", str(t.cert), "--tls-key", str(t.key), "--tls-ca", str(t.ca)]


def _code(address: str, files: TlsFiles, method: str, **fields: str) -> grpc.StatusCode:
    with grpc.secure_channel(address, channel_credentials(files)) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        try:
            getattr(stub, method)(getattr(admin_pb2, f"{method}Request")(**fields),
                                  timeout=20)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_a_person_certificate_is_pinned_and_its_role_comes_from_the_table(
        federation: Federation, tmp_path: Path) -> None:
    ca = tmp_path / "ca"
    certs.init_ca(ca)
    server = certs.issue_server(ca)
    op = certs.issue_operator(ca)
    federation.tls = TlsFiles(op.cert, op.key, op.ca)
    state = tmp_path / "state"
    federation.start_server(None, "--state-dir", str(state),
                            *_flags(TlsFiles(server.cert, server.key, server.ca)))
    # Bob's machine: his key and request; the CA: the signature.
    bob_dir = tmp_path / "bob"
    key, request = csr.request("bob", bob_dir, csr.Kind.OPERATOR)
    bob_cert = csr.sign(request, ca, csr.Kind.OPERATOR, tmp_path / "ca-out" / "bob.crt")
    bob = TlsFiles(bob_cert, key, ca / certs.CA_CERT)
    tls = ["--tls-cert", str(op.cert), "--tls-key", str(op.key), "--tls-ca", str(op.ca),
           "--address", federation.address]
    # Before he is in the table his operator certificate is the implicit admin (as before
    # people existed); the second factor (the operator token) is not his to give.
    assert _code(federation.address, bob, "ListJobs") == grpc.StatusCode.UNAUTHENTICATED
    added = cli("users", "add", "bob", "--role", "viewer", "--cert", str(bob_cert), "--json",
                *tls)
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["token"] is None
    assert _code(federation.address, bob, "ListJobs") == grpc.StatusCode.OK
    assert _code(federation.address, bob, "StopJob", job_id="x") == \
        grpc.StatusCode.PERMISSION_DENIED
    assert _code(federation.address, bob, "ListUsers") == grpc.StatusCode.PERMISSION_DENIED
    # A second certificate the CA signed for "bob" is not the pinned one.
    other = certs.issue_operator(ca, "bob", force=True)
    assert _code(federation.address, TlsFiles(other.cert, other.key, other.ca),
                 "ListJobs") == grpc.StatusCode.UNAUTHENTICATED
    revoked = cli("users", "revoke", "bob", *tls)
    assert revoked.returncode == 0, revoked.stderr
    assert _code(federation.address, bob, "ListJobs") == grpc.StatusCode.UNAUTHENTICATED
    records = _records_until(state / audit.AUDIT_FILE,
                             lambda r: r["actor"].endswith("(certificate of bob)")
                             and r["outcome"] == "UNAUTHENTICATED")
    assert [r["outcome"] for r in records if r["actor"] == "bob"][:3] == \
        ["OK", "PERMISSION_DENIED", "PERMISSION_DENIED"]
    assert records[-1]["action"] == "Admin.ListJobs"
    assert audit.verify(state / audit.AUDIT_FILE).ok


@pytest.mark.parametrize("garbage", ["../x", "a" * 65, "a b"])
def test_users_add_refuses_bad_names_before_asking(garbage: str) -> None:
    done = cli("users", "add", garbage, "--role", "viewer", "--address", "127.0.0.1:9")
    assert done.returncode != 0 and "name" in done.stderr
