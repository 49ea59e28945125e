"""Saved connections without a network: the file (atomic, private, damaged input refused), the
order in which options, saved connections and the environment win, and ids by prefix."""

from __future__ import annotations

import fcntl
import os
import stat
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedgpu.cli.app import app
from fedgpu.cli.common import connections
from fedgpu.cli.common.connect import Given, Origin, resolve
from fedgpu.cli.common.ids import unique_prefix
from fedgpu.core.errors import ConfigError


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "config"
    monkeypatch.setenv("FEDGPU_CONFIG_DIR", str(folder))
    return folder


def _pem(path: Path) -> Path:
    path.write_text("-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n")
    return path


def _cli(*args: str, stdin: str | None = None) -> str:
    r = CliRunner().invoke(app, list(args), input=stdin)
    assert r.exit_code == 0, (r.output, r.exception)
    return r.output


def test_add_writes_a_private_file_and_the_token_apart(config: Path, tmp_path: Path) -> None:
    ca = _pem(tmp_path / "ca.crt")
    out = _cli("connection", "add", "prod", "--address", "agg:50051", "--tls-ca", str(ca),
               "--token-stdin", stdin="s3cret\n")
    assert "'prod'" in out and "the default" in out
    path = config / "connections.toml"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "s3cret" not in path.read_text()  # the file holds paths, never the secret
    saved = connections.load().saved["prod"]
    assert saved.tls_ca == ca.resolve()
    assert saved.token_file is not None
    assert stat.S_IMODE(saved.token_file.stat().st_mode) == 0o600
    assert connections.read_token(saved.token_file) == "s3cret"
    # A second connection does not take the default from the first.
    _cli("connection", "add", "lab", "--address", "lab:50051")
    assert connections.load().default == "prod"
    _cli("connection", "use", "lab")
    assert connections.load().default == "lab"
    listing = _cli("connection", "list")
    assert "* " in listing and "prod" in listing and "lab:50051" in listing


def test_add_refuses_what_would_fail_later(config: Path, tmp_path: Path) -> None:
    for args, why in ((["--address", "nohostport"], "HOST:PORT"),
                      (["--address", "a:1", "--tls-ca", str(tmp_path / "missing.crt")],
                       "does not exist"),
                      (["--address", "a:1", "--tls-cert", str(_pem(tmp_path / "c.crt"))],
                       "go together"),
                      (["--address", "a:1", "--insecure", "--tls-ca",
                        str(_pem(tmp_path / "ca.crt"))], "contradict")):
        r = CliRunner().invoke(app, ["connection", "add", "x", *args])
        assert r.exit_code != 0
        assert why in str(r.exception), r.exception
    assert not (config / "connections.toml").exists()  # nothing half-saved
    _cli("connection", "add", "x", "--address", "a:1")
    r = CliRunner().invoke(app, ["connection", "add", "x", "--address", "b:2"])
    assert "--force" in str(r.exception)
    _cli("connection", "add", "x", "--address", "b:2", "--force")
    assert connections.load().saved["x"].address == "b:2"


def test_a_damaged_file_is_refused_and_kept(config: Path) -> None:
    config.mkdir()
    path = config / "connections.toml"
    for text, why in (("default = \n", "not valid TOML"),
                      ('[connections.a]\naddress = "a:1"\ncolour = "red"\n', "unknown key"),
                      ('default = "b"\n[connections.a]\naddress = "a:1"\n', "names no saved"),
                      ('[connections.a]\naddress = "nope"\n', "HOST:PORT")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=why):
            connections.load()
        r = CliRunner().invoke(app, ["connection", "add", "z", "--address", "z:1"])
        assert r.exit_code != 0 and why in str(r.exception)
        assert path.read_text() == text  # a bad read is never written back


def test_remove_forgets_the_connection_and_its_token(config: Path) -> None:
    _cli("connection", "add", "a", "--address", "a:1", "--token-stdin", stdin="t")
    token = connections.load().saved["a"].token_file
    assert token is not None and token.exists()
    _cli("connection", "remove", "a")
    assert connections.load() == connections.Connections()
    assert not token.exists()


def test_the_order_options_saved_connection_environment(config: Path, tmp_path: Path) -> None:
    ca, cert, key, other = (_pem(tmp_path / n) for n in ("ca", "cert", "key", "other"))
    token = tmp_path / "token"
    token.write_text("saved-token\n")
    with connections.editing() as box:
        box[0] = connections.put(box[0], connections.SavedConnection(
            "prod", "prod:50051", tls_ca=ca, tls_cert=cert, tls_key=key, token_file=token),
            make_default=True)
        box[0] = connections.put(box[0], connections.SavedConnection("plain", "plain:1",
                                                                     insecure=True), False)

    # Nothing given: the default connection, whole.
    t = resolve(Given())
    assert (t.address, t.token, t.connection, t.origin) == ("prod:50051", "saved-token",
                                                            "prod", Origin.DEFAULT_CONNECTION)
    assert t.tls is not None and (t.tls.ca, t.tls.cert, t.tls.key) == (ca, cert, key)
    # An address (flag or environment) without a connection name: not the default's
    # credentials, which belong to another address.
    for cli in (frozenset({"address"}), frozenset()):
        t = resolve(Given(address="other:1", token="env-token", on_command_line=cli))
        assert (t.address, t.token, t.tls, t.connection) == ("other:1", "env-token", None,
                                                             None)
    # Named: command-line options win one by one, the environment loses to the saved values,
    # and the saved TLS files replace the environment's as a set.
    t = resolve(Given(connection="prod", address="tunnel:9", token="env-token",
                      tls_ca=other, on_command_line=frozenset({"connection", "address"})))
    assert (t.address, t.token) == ("tunnel:9", "saved-token")
    assert t.tls is not None and t.tls.ca == ca
    t = resolve(Given(connection="prod", token="cli-token", tls_ca=other,
                      on_command_line=frozenset({"token", "tls_ca"})))
    assert t.token == "cli-token" and t.tls is not None and (t.tls.ca, t.tls.cert) == (other,
                                                                                        cert)
    # --insecure drops the saved TLS files; with --tls-* on the command line it contradicts.
    assert resolve(Given(connection="prod", insecure=True)).tls is None
    with pytest.raises(ConfigError, match="contradict"):
        resolve(Given(connection="prod", insecure=True, tls_ca=other,
                      on_command_line=frozenset({"insecure", "tls_ca"})))
    # A saved insecure connection ignores FEDGPU_TLS_* from the environment.
    assert resolve(Given(connection="plain", tls_ca=other)).tls is None
    with pytest.raises(ConfigError, match="no saved connection 'nope'.*plain, prod"):
        resolve(Given(connection="nope"))


def test_no_saved_connections_keeps_the_old_defaults(config: Path) -> None:
    t = resolve(Given())
    assert (t.address, t.token, t.tls, t.origin) == ("localhost:50051", None, None, Origin.BUILT_IN)


def test_concurrent_writers_lose_nothing(config: Path) -> None:
    # Each child adds its own connection through the same read-modify-write.
    pids = []
    for i in range(8):
        pid = os.fork()
        if pid == 0:
            try:
                with connections.editing() as box:
                    box[0] = connections.put(box[0], connections.SavedConnection(
                        f"c{i}", f"h{i}:1"), make_default=False)
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    assert sorted(connections.load().saved) == [f"c{i}" for i in range(8)]


def test_unique_prefix() -> None:
    ids = ["3f2a9c1b0d4e", "3f2b00000000", "a1b2c3d4e5f6"]
    assert unique_prefix("a", ids) == "a1b2c3d4e5f6"
    assert unique_prefix("3f2a", ids) == "3f2a9c1b0d4e"
    assert unique_prefix("3f2b00000000", ids) == "3f2b00000000"
    with pytest.raises(ConfigError, match="'3f2' starts 2 job ids .*give more"):
        unique_prefix("3f2", ids)
    with pytest.raises(ConfigError, match="no job 'ff' on this aggregator"):
        unique_prefix("ff", ids)
    with pytest.raises(ConfigError, match="no job id given"):
        unique_prefix(" ", ids)


def test_the_compose_aggregator_as_a_connection(tmp_path: Path) -> None:
    from fedgpu.cli.deploy.compose import compose_connection

    certs = tmp_path / "compose" / "certs"
    # The shape `docker compose config --format json` prints: variables resolved, absolute
    # paths, long-form ports and volumes.
    config = {"services": {"aggregator": {
        "environment": {"FEDGPU_OPERATOR_TOKEN": "op-token", "FEDGPU_TOKEN": "node-token"},
        "ports": [{"mode": "ingress", "host_ip": "0.0.0.0", "target": 50051,
                   "published": "50061", "protocol": "tcp"},
                  {"mode": "ingress", "host_ip": "127.0.0.1", "target": 8080,
                   "published": "8080", "protocol": "tcp"}],
        "volumes": [{"type": "volume", "source": "checkpoints", "target": "/var/lib/fedgpu"},
                    {"type": "bind", "source": str(certs / "server"), "target": "/certs",
                     "read_only": True}]}}}
    found = compose_connection(config)
    assert found.address == "127.0.0.1:50061"  # published everywhere: loopback from here
    assert found.tls_ca == certs / "ca.crt"
    assert found.tls_cert == certs / "operators" / "operator" / "operator.crt"
    assert found.tls_key == certs / "operators" / "operator" / "operator.key"
    assert found.token == "op-token"
    config["services"]["aggregator"]["ports"] = []
    with pytest.raises(Exception, match="publishes no port for 50051"):
        compose_connection(config)


def test_a_stuck_writer_is_waited_for_a_bounded_time(config: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connections, "LOCK_WAIT_S", 0.3)
    config.mkdir()
    held = os.open(config / ".connections.toml.lock", os.O_RDWR | os.O_CREAT, 0o600)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # another process holds the lock (flock locks are per open file)
        fcntl.flock(held, fcntl.LOCK_EX)
        os.write(ready_w, b"x")
        time.sleep(30)
        os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"x"
        with pytest.raises(ConfigError, match="being changed by another process"):
            with connections.editing():
                pass
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        for fd in (held, ready_r, ready_w):
            os.close(fd)
    with connections.editing() as box:  # free again
        box[0] = connections.put(box[0], connections.SavedConnection("a", "a:1"), False)
    assert "a" in connections.load().saved


def test_making_a_certificate_never_changes_the_default_connection(config: Path,
                                                                     tmp_path: Path) -> None:
    d = tmp_path / "certs"
    _cli("certs", "init", "--dir", str(d))
    out = _cli("certs", "operator", "alice", "--dir", str(d), "--address", "agg:50051")
    # Saved under its name, said so, and not the default: commands without --connection keep
    # talking to what they talked to before.
    assert "saved connection 'alice' (agg:50051)" in out
    assert "fedgpu connection use alice" in out
    assert connections.load().default is None
    _cli("connection", "add", "prod", "--address", "prod:50051", "--default")
    _cli("certs", "operator", "bob", "--dir", str(d), "--address", "agg:50051")
    assert connections.load().default == "prod"
    out = _cli("certs", "operator", "carol", "--dir", str(d), "--address", "agg:50051",
               "--default")
    assert "(agg:50051, the default)" in out and connections.load().default == "carol"


def test_certs_server_keeps_the_loopback_names_beside_those_given(tmp_path: Path) -> None:
    from fedgpu.core.tls_diagnosis import cert_facts

    d = tmp_path / "certs"
    _cli("certs", "init", "--dir", str(d))
    out = _cli("certs", "server", "--dir", str(d), "--san", "agg.example.org",
               "--san", "10.0.0.5")
    names = cert_facts((d / "server" / "server.crt").read_bytes()).names
    assert set(names) == {"aggregator", "localhost", "127.0.0.1", "agg.example.org", "10.0.0.5"}
    assert "agg.example.org" in out
    _cli("certs", "server", "--dir", str(d), "--san", "agg.example.org", "--no-default-sans",
         "--force")
    names = cert_facts((d / "server" / "server.crt").read_bytes()).names
    assert set(names) == {"aggregator", "agg.example.org"}  # the common name stays a name
    r = CliRunner().invoke(app, ["certs", "server", "--dir", str(d), "--no-default-sans",
                                 "--force"])
    assert r.exit_code != 0 and "needs at least one --san" in str(r.exception)
