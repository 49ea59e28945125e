"""Saved connections against a real aggregator (mutual TLS and an operator token, on
loopback): `fedgpu certs operator` and `fedgpu connection add` record one, and then the
admin commands need no options; options given still win. Job ids by prefix, `job stop`
waiting for the state it ends in, and tables that fit 80 columns, on the same aggregator."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fedgpu.core.tls import TlsFiles
from tests.fixtures.federation import (
    FEDGPU,
    OPERATOR_TOKEN,
    ROOT,
    Federation,
    base_env,
    free_port,
    write_job,
)


@dataclass
class Operated:
    fed: Federation
    certs: Path
    config: Path

    def cli(self, *args: str, operator_token: str | None = None, stdin: str | None = None,
            **env: str) -> subprocess.CompletedProcess[str]:
        """`fedgpu ARGS` with this test's config dir and, unless given, no operator token and
        no aggregator address in the environment: what it finds, it found saved."""
        e = base_env(FEDGPU_CONFIG_DIR=str(self.config), **env)
        for name in ("FEDGPU_OPERATOR_TOKEN", "FEDGPU_AGGREGATOR", "FEDGPU_TLS_CA",
                     "FEDGPU_TLS_CERT", "FEDGPU_TLS_KEY", "FEDGPU_CONNECTION"):
            if name not in env:
                e.pop(name, None)
        if operator_token is not None:
            e["FEDGPU_OPERATOR_TOKEN"] = operator_token
        return subprocess.run([*FEDGPU, *args], capture_output=True, text=True, env=e,
                              cwd=ROOT, timeout=120, input=stdin)


@pytest.fixture(scope="module")
def operated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operated]:
    tmp = tmp_path_factory.mktemp("connections")
    fed = Federation(tmp)
    op = Operated(fed, tmp / "certs", tmp / "config")
    try:
        for args in (["init"], ["server"]):
            r = op.cli("certs", *args, "--dir", str(op.certs))
            assert r.returncode == 0, r.stderr
        server = op.certs / "server"
        port = free_port()
        r = op.cli("certs", "operator", "--dir", str(op.certs), "--address",
                   f"127.0.0.1:{port}", "--default")
        assert r.returncode == 0, r.stderr
        assert "saved connection 'operator'" in r.stdout and "the default" in r.stdout
        fed.tls = TlsFiles(op.certs / "operators/operator/operator.crt",
                           op.certs / "operators/operator/operator.key", op.certs / "ca.crt")
        fed.start_server(None, "--tls-cert", str(server / "server.crt"), "--tls-key",
                         str(server / "server.key"), "--tls-ca", str(server / "ca.crt"),
                         port=port)
        yield op
    finally:
        fed.stop()


def test_certs_operator_saves_a_connection_the_commands_use(operated: Operated) -> None:
    # The saved connection holds the address and the certificate; the token (a second
    # factor under mutual TLS here) comes from the environment as before.
    r = operated.cli("status", "--json", operator_token=OPERATOR_TOKEN)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["state"] == "idle"
    # Without the token the aggregator itself says what is missing: the connection was used.
    r = operated.cli("status")
    assert r.returncode == 1 and "no token presented" in r.stderr, r.stderr
    shown = json.loads(operated.cli("connection", "show", "--json").stdout)
    assert shown["connection"] == "operator" and shown["address"] == operated.fed.address
    assert shown["tls_cert"].endswith("operator.crt")


def test_a_connection_with_its_token_needs_nothing_else(operated: Operated) -> None:
    op = operated.certs / "operators" / "operator"
    r = operated.cli("connection", "add", "compose", "--address", operated.fed.address,
                     "--tls-ca", str(operated.certs / "ca.crt"), "--tls-cert",
                     str(op / "operator.crt"), "--tls-key", str(op / "operator.key"),
                     "--token-stdin", "--default", stdin=OPERATOR_TOKEN + "\n")
    assert r.returncode == 0, r.stderr
    assert OPERATOR_TOKEN not in (operated.config / "connections.toml").read_text()
    for args in (["status"], ["nodes"], ["job", "list"], ["health"],
                 ["status", "--connection", "compose"]):
        r = operated.cli(*args)
        assert r.returncode == 0, (args, r.stderr)
    r = operated.cli("status", FEDGPU_CONNECTION="compose")
    assert r.returncode == 0, r.stderr
    assert json.loads(operated.cli("nodes", "--json").stdout)["nodes"] == []
    # The group's subcommand takes the same connection: the aggregator itself answers.
    r = operated.cli("nodes", "forget", "nobody")
    assert r.returncode == 1 and "nobody" in r.stderr and "aggregator at" in r.stderr


def test_doctor_checks_a_saved_connection(operated: Operated, tmp_path: Path) -> None:
    r = operated.cli("doctor", "--json", "--connection", "compose",
                     DOCKER_HOST=f"unix://{tmp_path}/no-engine.sock")
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    agg = checks["aggregator"]
    # Reached over mutual TLS with the saved certificate, and asked as the operator.
    assert agg["status"] == "ok" and "SERVING" in agg["detail"], agg
    assert "node(s) alive" in agg["detail"], agg  # what only the operator may read


def test_options_given_win_over_the_saved_connection(operated: Operated) -> None:
    # An address alone: no saved credentials are borrowed for it.
    r = operated.cli("status", "--address", "127.0.0.1:1")
    assert r.returncode == 1 and "cannot reach aggregator at 127.0.0.1:1" in r.stderr
    # A named connection and an address: that connection's credentials, there.
    r = operated.cli("status", "--connection", "compose", "--address", "127.0.0.1:1")
    assert "cannot reach aggregator at 127.0.0.1:1" in r.stderr
    assert "[saved connection 'compose'" in r.stderr  # and the error says where it came from
    # --insecure drops the saved TLS: the aggregator speaks TLS and we do not.
    r = operated.cli("status", "--insecure")
    assert r.returncode == 1 and "TLS" in r.stderr, r.stderr
    # A wrong token given on the command line replaces the saved one.
    r = operated.cli("status", "--token", "wrong")
    assert r.returncode == 1 and "wrong token" in r.stderr, r.stderr
    r = operated.cli("status", "--connection", "nope")
    assert r.returncode == 2 and "no saved connection 'nope'" in r.stderr
    assert "compose, operator" in r.stderr


def test_job_ids_by_prefix_stop_waits_and_tables_fit(operated: Operated,
                                                     tmp_path: Path) -> None:
    # No node ever joins: the first job waits for nodes, the second queues behind it.
    ids = []
    for name in ("first", "second"):
        r = operated.cli("job", "submit", str(write_job(tmp_path / f"{name}.toml",
                                                        name=name)), "--json")
        assert r.returncode == 0, r.stderr
        ids.append(json.loads(r.stdout)["job_id"])
    first, second = ids
    short = next(i for i in range(1, 12) if first[:i] != second[:i])
    r = operated.cli("job", "status", first[:short], "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["job_id"] == first
    # The table shows whole 12-character ids within 80 columns.
    r = operated.cli("job", "list", COLUMNS="80")
    assert r.returncode == 0, r.stderr
    assert first in r.stdout and second in r.stdout
    assert max(len(line) for line in r.stdout.splitlines()) <= 80, r.stdout
    # Stopping the active (waiting) job prints the state it ended in, not the one before.
    r = operated.cli("job", "stop", first[:short])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"job {first} stopped"
    r = operated.cli("job", "stop", second, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["state"] == "stopped"
    r = operated.cli("job", "logs", first[:short])
    assert r.returncode == 0 and "stop requested" in r.stdout, r.stdout
    # A prefix of no job is refused with the listing to look at.
    r = operated.cli("job", "status", "zz")
    assert r.returncode == 2 and "no job 'zz'" in r.stderr
    assert "fedgpu job list" in r.stderr
