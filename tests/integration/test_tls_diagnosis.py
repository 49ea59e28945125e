"""TLS that says what is wrong: each way a TLS connection to an aggregator fails gives one line
naming the cause and the fix, the same on the node, in `fedgpu doctor` and in the admin CLI.

Real gRPC servers on loopback, certificates made by `fedgpu certs`' own code (and, for dates
`certs` would never choose, by the cryptography library with those dates)."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2_grpc

from fedgpu.core import certs, tls_diagnosis
from fedgpu.core.tls import TlsFiles, server_credentials
from fedgpu.core.tls_diagnosis import Cause
from tests.fixtures.federation import Federation, cli, free_port


def _dated(ca_dir: Path, out: Path, start: dt.datetime, end: dt.datetime) -> TlsFiles:
    """A server certificate for localhost/127.0.0.1 with the validity given, from our CA."""
    ca = x509.load_pem_x509_certificate((ca_dir / certs.CA_CERT).read_bytes())
    ca_key = serialization.load_pem_private_key((ca_dir / certs.CA_KEY).read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aggregator")]))
        .issuer_name(ca.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
        .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    out.mkdir(parents=True)
    (out / "server.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / "server.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return TlsFiles(out / "server.crt", out / "server.key", None)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    ours, theirs = tmp_path_factory.mktemp("ours"), tmp_path_factory.mktemp("theirs")
    certs.init_ca(ours)
    certs.init_ca(theirs)
    good = certs.issue_server(ours)
    # tls.md's example: a certificate for other names only (no localhost, no 127.0.0.1).
    (ours / "named").mkdir()
    for f in (certs.CA_CERT, certs.CA_KEY):
        (ours / "named" / f).write_bytes((ours / f).read_bytes())
    names = certs.issue_server(ours / "named", sans=["aggregator", "agg.example.org",
                                                      "10.0.0.5"])
    now = dt.datetime.now(dt.UTC)
    site = certs.issue_node(ours, "site-a")
    return {
        "good": TlsFiles(good.cert, good.key, None),
        "mutual": TlsFiles(good.cert, good.key, good.ca),
        "names": TlsFiles(names.cert, names.key, None),
        "expired": _dated(ours, ours / "expired", now - dt.timedelta(days=400),
                          now - dt.timedelta(days=30)),
        "future": _dated(ours, ours / "future", now + dt.timedelta(days=30),
                         now + dt.timedelta(days=400)),
        "ca": TlsFiles(None, None, good.ca),
        "other-ca": TlsFiles(None, None, theirs / certs.CA_CERT),
        "site": TlsFiles(site.cert, site.key, site.ca),
    }


@pytest.fixture
def serve() -> Iterator:
    servers: list[grpc.Server] = []

    def start(tls: TlsFiles | None) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        port = (server.add_secure_port("127.0.0.1:0", server_credentials(tls))
                if tls is not None else server.add_insecure_port("127.0.0.1:0"))
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for s in servers:
        s.stop(0)


# (server's TLS, client's TLS, the cause, what the line says)
CASES = {
    "name-mismatch": ("names", "ca", Cause.NAME_MISMATCH,
                      "the aggregator's certificate names aggregator, agg.example.org, "
                      "10.0.0.5 - not 127.0.0.1: connect to one of those or re-issue with "
                      "--san 127.0.0.1"),
    "expired": ("expired", "ca", Cause.EXPIRED, "expired on"),
    "not-yet-valid": ("future", "ca", Cause.NOT_YET_VALID, "is valid only from"),
    "wrong-ca": ("good", "other-ca", Cause.WRONG_CA, "is not signed by --tls-ca"),
    "missing-client-cert": ("mutual", "ca", Cause.CLIENT_CERT_REQUIRED,
                            "requires a client certificate"),
    "plaintext-against-tls": ("good", None, Cause.SERVER_SPEAKS_TLS,
                              "speaks TLS and we do not"),
    "tls-against-plaintext": (None, "ca", Cause.SERVER_PLAINTEXT,
                              "serves plaintext gRPC and we speak TLS"),
}


def _flags(t: TlsFiles | None) -> list[str]:
    if t is None:
        return []
    return [x for flag, p in (("--tls-cert", t.cert), ("--tls-key", t.key), ("--tls-ca", t.ca))
            if p is not None for x in (flag, str(p))]


def _one_line(stderr: str, expected: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], stderr[-3000:]
    assert "Traceback" not in stderr and "is it running" not in stderr
    assert "unreachable; retrying" not in stderr


@pytest.mark.parametrize("case", list(CASES))
def test_each_tls_failure_is_named_with_its_fix(
        case: str, pki: dict[str, TlsFiles], serve, digits_split: list[Path],
        tmp_path: Path) -> None:
    server_tls, client_tls, cause, text = CASES[case]
    address = serve(pki[server_tls] if server_tls else None)
    client = pki[client_tls] if client_tls else None

    found = tls_diagnosis.diagnose(address, client)
    assert found is not None and found.cause is cause and text in found.message, found

    # The admin CLI: one line, exit 1, nothing on stdout.
    r = cli("status", "--address", address, *_flags(client))
    assert r.returncode == 1 and r.stdout == "", r.stderr
    _one_line(r.stderr, text)

    # doctor: the aggregator check fails with the same line.
    r = cli("doctor", "--json", "--address", address, *_flags(client))
    agg = {c["name"]: c for c in json.loads(r.stdout)["checks"]}["aggregator"]
    assert agg["status"] == "fail" and text in agg["detail"], agg

    # The node: one line and exit 1, at once (not "unreachable; retrying" forever).
    r = cli("node", "start", "--aggregator", address, "--data", str(digits_split[0]),
            "--gpu", "none", "--no-prestart", "--connect-timeout", "60",
            "--status-file", str(tmp_path / "node.status"), *_flags(client), timeout=90)
    assert r.returncode == 1, r.stderr[-3000:]
    _one_line(r.stderr, text)

    # Simulated nodes, the same (one probe for the process).
    r = cli("sim", "--aggregator", address, "--nodes", "3", "--params", "10", "--tensors", "1",
            *_flags(client), timeout=90)
    assert r.returncode == 1, r.stderr[-3000:]
    _one_line(r.stderr, text)


def test_a_working_connection_has_nothing_to_diagnose(pki: dict[str, TlsFiles], serve) -> None:
    assert tls_diagnosis.diagnose(serve(pki["good"]), pki["ca"]) is None
    assert tls_diagnosis.diagnose(serve(None), None) is None
    assert tls_diagnosis.diagnose(serve(pki["mutual"]), pki["site"]) is None


def test_a_node_certificate_on_an_operator_command_says_so(
        federation: Federation, pki: dict[str, TlsFiles]) -> None:
    federation.tls = pki["site"]
    federation.start_server(None, *_flags(pki["mutual"]))
    r = cli("status", "--address", federation.address, *_flags(pki["site"]))
    assert r.returncode == 1, r.stderr
    _one_line(r.stderr, "is a node certificate (node 'site-a'); this command needs the "
                        "operator credential")
    assert "FEDGPU_TOKEN" not in r.stderr


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "mutual-tls"])
def test_a_wrong_port_says_what_answers_there(federation: Federation, pki: dict[str, TlsFiles],
                                              tls: bool) -> None:
    ui, metrics, bulk_port = free_port(), free_port(), free_port()
    server_flags = _flags(pki["mutual"]) if tls else []
    client = pki["site"] if tls else None
    federation.tls = client
    federation.start_server(None, "--ui-port", str(ui), "--metrics-port", str(metrics),
                            "--bulk-port", str(bulk_port), *server_flags)
    bulk = f"127.0.0.1:{bulk_port}"
    r = cli("status", "--address", bulk, *_flags(client))
    _one_line(r.stderr, f"{bulk} is the aggregator's bulk data port, not its gRPC port: use "
                        "its --port")
    for other in (ui, metrics):
        r = cli("status", "--address", f"127.0.0.1:{other}", *_flags(client))
        _one_line(r.stderr, f"an HTTP server answers at 127.0.0.1:{other} (the aggregator's "
                            "dashboard or metrics port?)")
    r = cli("doctor", "--json", "--address", bulk, *_flags(client))
    agg = {c["name"]: c for c in json.loads(r.stdout)["checks"]}["aggregator"]
    assert agg["status"] == "fail" and "bulk data port" in agg["detail"], agg


def test_a_running_node_names_a_tls_failure_after_a_restart_once(
        federation: Federation, pki: dict[str, TlsFiles], digits_split: list[Path],
        tmp_path: Path) -> None:
    """The aggregator comes back with a certificate that does not name the address the node
    dials: the node keeps waiting for it (as for any outage) and says why, once."""
    federation.tls = pki["site"]
    server = federation.start_server(None, "--heartbeat-s", "1", *_flags(pki["mutual"]))
    node = federation.start_node("site-a", digits_split[0], "--gpu", "none", "--no-prestart",
                                 *_flags(pki["site"]))
    end = time.monotonic() + 60
    while "registered with" not in node.text():
        assert time.monotonic() < end and node.popen.poll() is None, node.text()[-2000:]
        time.sleep(0.3)
    port = federation.address.rsplit(":", 1)[1]
    server.popen.kill()  # a crash: no goodbye that could end the node's loop
    server.popen.wait(timeout=30)
    names = pki["names"]
    federation.spawn("aggregator-2", ["server", "start", "--host", "127.0.0.1", "--port", port,
                                      "--bulk-port", "0", *_flags(TlsFiles(
                                          names.cert, names.key, pki["site"].ca))])
    line = "the aggregator's certificate names aggregator, agg.example.org, 10.0.0.5 - not " \
           "127.0.0.1"
    end = time.monotonic() + 60
    while line not in node.text():
        assert time.monotonic() < end and node.popen.poll() is None, node.text()[-3000:]
        time.sleep(0.5)
    time.sleep(12)  # past the next look: the same cause is not said again
    assert node.text().count(line) == 1, node.text()[-3000:]
    assert node.popen.poll() is None  # it waits for its aggregator, as for any outage
