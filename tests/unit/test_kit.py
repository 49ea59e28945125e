"""Startup kits (`fedgpu kit site|operator`, fedgpu/cli/kit/): what a kit holds, key modes,
no silent overwrite, the archive, a certificate already issued reused, and node.toml read
back the way `fedgpu node start --kit` reads it, with clear errors for a kit that is not one."""

from __future__ import annotations

import stat
import tarfile
import tomllib
from pathlib import Path

import pytest

from fedgpu.cli.kit.files import NodeKit, read_node_kit
from fedgpu.core import certs
from fedgpu.core.errors import ConfigError
from tests.fixtures.federation import cli


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _ca(tmp: Path) -> Path:
    ca = tmp / "certs"
    certs.init_ca(ca)
    return ca


def test_a_site_kit_holds_what_node_start_needs(tmp_path: Path) -> None:
    ca = _ca(tmp_path)
    out = tmp_path / "kits" / "site-a"
    r = cli("kit", "site", "site-a", "--aggregator", "10.200.0.1:50051", "--ca-dir", str(ca),
            "--out", str(out), "--data", "/srv/site-a", "--gpu", "none", "--archive")
    assert r.returncode == 0, r.stderr
    assert f"fedgpu node start --kit {out}" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["ca.crt", "node.crt", "node.key",
                                                      "node.toml"]
    assert _mode(out / "node.key") == 0o600 and _mode(out) == 0o700
    pem = (out / "node.crt").read_bytes()
    assert certs.role(pem) is certs.Role.NODE and certs.identity(pem) == "site-a"
    assert (out / "ca.crt").read_bytes() == (ca / "ca.crt").read_bytes()
    kit = read_node_kit(out)
    assert kit == NodeKit("10.200.0.1:50051", "site-a", out / "node.crt", out / "node.key",
                          out / "ca.crt", Path("/srv/site-a"), "none")
    # The archive unpacks to the same files, the key still private.
    with tarfile.open(out.with_name("site-a.tar.gz")) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert sorted(members) == [f"site-a/{n}" for n in ("ca.crt", "node.crt", "node.key",
                                                         "node.toml")]
    assert members["site-a/node.key"].mode & 0o777 == 0o600

    # An existing kit is not replaced unless asked; the certificate issued is reused.
    r = cli("kit", "site", "site-a", "--aggregator", "10.200.0.1:50051", "--ca-dir", str(ca),
            "--out", str(out))
    assert r.returncode != 0 and "--force" in r.stderr
    assert read_node_kit(out).data == Path("/srv/site-a")  # untouched
    r = cli("kit", "site", "site-a", "--aggregator", "agg:50051", "--ca-dir", str(ca),
            "--out", str(out), "--force")
    assert r.returncode == 0, r.stderr
    assert read_node_kit(out).aggregator == "agg:50051" and read_node_kit(out).data is None
    assert (out / "node.crt").read_bytes() == pem
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no leftovers


def test_an_operator_kit_is_a_saved_connection(tmp_path: Path) -> None:
    ca = _ca(tmp_path)
    out = tmp_path / "alice-kit"
    r = cli("kit", "operator", "alice", "--aggregator", "agg.example.org:50051", "--ca-dir",
            str(ca), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert _mode(out / "operator.key") == 0o600
    assert certs.role((out / "operator.crt").read_bytes()) is certs.Role.OPERATOR
    doc = tomllib.loads((out / "connections.toml").read_text())
    assert doc["default"] == "alice"
    assert doc["connections"]["alice"] == {
        "address": "agg.example.org:50051", "tls_ca": "ca.crt", "tls_cert": "operator.crt",
        "tls_key": "operator.key"}
    # The saved connection resolves inside the kit (read as `--connection alice` reads it).
    from fedgpu.cli.common import connections

    saved = connections.load(out / "connections.toml").saved["alice"]
    assert saved.tls_key == out / "operator.key" and saved.tls_key.is_file()


def test_bad_input_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    ca = _ca(tmp_path)
    out = tmp_path / "k"
    for args, why in ((["--aggregator", "no-port"], "HOST:PORT"),
                      (["--aggregator", "a:1", "--gpu", "lots"], "none, offer, enforce")):
        r = cli("kit", "site", "s", "--ca-dir", str(ca), "--out", str(out), *args)
        assert r.returncode != 0 and why in r.stderr, r.stderr
    r = cli("kit", "site", "s", "--aggregator", "a:1", "--ca-dir", str(tmp_path / "nope"),
            "--out", str(out))
    assert r.returncode != 0 and "no CA" in r.stderr
    assert not out.exists()


def test_a_directory_that_is_not_a_kit_is_named_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fedgpu kit site NAME"):
        read_node_kit(tmp_path)
    (tmp_path / "node.toml").write_text('aggregator = "a:1"\nname = "s"\nport = 1\n')
    with pytest.raises(ConfigError, match="unknown key.*port"):
        read_node_kit(tmp_path)
    (tmp_path / "node.toml").write_text('aggregator = "a:1"\nname = "s"\n')
    with pytest.raises(ConfigError, match="lacks tls_cert"):
        read_node_kit(tmp_path)
    (tmp_path / "node.toml").write_text('aggregator = "a:1"\nname = "s"\ntls_cert = "x"\n'
                                        'tls_key = "y"\ntls_ca = "z"\n')
    with pytest.raises(ConfigError, match="not a file"):
        read_node_kit(tmp_path)
    # And `node start --kit` says so, before anything starts.
    r = cli("node", "start", "--kit", str(tmp_path / "missing"))
    assert r.returncode != 0 and "fedgpu kit site NAME" in r.stderr, r.stderr


@pytest.mark.parametrize("kind", ["site", "operator"])
def test_a_kit_from_a_request_carries_no_key(tmp_path: Path, kind: str) -> None:
    """Threat model: the CA's host and the way back to the site must never hold the site's (or
    person's) private key. With --csr the kit is made from the request alone, so the key stays
    where `certs request` made it; a kit for another name than the request's is refused."""
    ca = _ca(tmp_path)
    site = tmp_path / "site" / "site-a"
    r = cli("certs", "request", "site-a", "--out", str(site), "--kind", kind)
    assert r.returncode == 0, r.stderr
    key_name = "node.key" if kind == "site" else "operator.key"
    key = (site / key_name).read_bytes()
    transit = tmp_path / "transit"
    transit.mkdir()
    (transit / "site-a.csr").write_bytes((site / "site-a.csr").read_bytes())
    out = tmp_path / "kits" / "site-a"
    wrong = cli("kit", kind if kind == "site" else "operator", "site-b", "--aggregator",
                "agg:50051", "--ca-dir", str(ca), "--csr", str(transit / "site-a.csr"),
                "--out", str(out))
    assert wrong.returncode != 0 and "not 'site-b'" in wrong.stderr and not out.exists()
    r = cli("kit", kind, "site-a", "--aggregator", "agg:50051", "--ca-dir", str(ca), "--csr",
            str(transit / "site-a.csr"), "--out", str(out), "--archive")
    assert r.returncode == 0, r.stderr
    everything = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_relative_to(site)]
    for path in everything:
        data = path.read_bytes()
        if path.suffix == ".gz":
            with tarfile.open(path) as tar:
                data = b"".join(tar.extractfile(m).read() for m in tar.getmembers()
                                if m.isfile())
        assert key not in data and (b"PRIVATE KEY" not in data or path == ca / "ca.key"), path
    # Unpacked where the key is, the kit is complete: node start --kit (or the saved
    # connection) finds the site's own key.
    with tarfile.open(out.with_name("site-a.tar.gz")) as tar:
        tar.extractall(site.parent, filter="data")
    if kind == "site":
        kit = read_node_kit(site)
        assert kit.tls_key == site / "node.key" and kit.tls_key.read_bytes() == key
        assert certs.identity(kit.tls_cert.read_bytes()) == "site-a"
    else:
        from fedgpu.cli.common import connections

        saved = connections.load(site / "connections.toml").saved["site-a"]
        assert saved.tls_key == site / "operator.key"
        assert certs.role(saved.tls_cert.read_bytes()) is certs.Role.OPERATOR
    r = cli("kit", "site", "x", "--aggregator", "a:1", "--ca-dir", str(ca), "--key-path", "/k",
            "--out", str(tmp_path / "x"))
    assert r.returncode != 0 and "--csr" in r.stderr


def test_a_site_kit_carries_the_sites_policy(tmp_path: Path) -> None:
    """The kit carries the site's policy file as policy.toml, named in node.toml and resolved
    inside the kit; a bad policy file is refused with the parser's error and writes nothing.

    Threat model: the kit maker (the CA's host) only hands the site a starting file; the
    policy is the site's, which may replace it in its kit, and the node checks whatever file it
    starts with (test below), never a copy the aggregator holds."""
    ca = _ca(tmp_path)
    policy = tmp_path / "site-policy.toml"
    text = 'studies = ["onco"]\nmax_rounds = 50 # per job\n'
    policy.write_text(text)
    out = tmp_path / "kits" / "site-a"
    r = cli("kit", "site", "site-a", "--aggregator", "agg:50051", "--ca-dir", str(ca),
            "--out", str(out), "--policy", str(policy))
    assert r.returncode == 0, r.stderr
    assert (out / "policy.toml").read_text() == text  # the site's very text, comments kept
    assert tomllib.loads((out / "node.toml").read_text())["policy"] == "policy.toml"
    assert read_node_kit(out).policy == out / "policy.toml"
    # A kit without --policy names none.
    plain = tmp_path / "kits" / "site-b"
    assert cli("kit", "site", "site-b", "--aggregator", "agg:50051", "--ca-dir", str(ca),
               "--out", str(plain)).returncode == 0
    assert read_node_kit(plain).policy is None and not (plain / "policy.toml").exists()

    bad = tmp_path / "bad.toml"
    for content, why in (('max_round = 5\n', "did you mean 'max_rounds'"),
                         ('studies = [\n', "not valid TOML"),
                         ('x' * (70 << 10), "over")):
        bad.write_text(content)
        again = tmp_path / "kits" / "site-c"
        r = cli("kit", "site", "site-c", "--aggregator", "agg:50051", "--ca-dir", str(ca),
                "--out", str(again), "--policy", str(bad))
        assert r.returncode != 0 and why in r.stderr, r.stderr
        assert not again.exists()
    r = cli("kit", "site", "site-c", "--aggregator", "agg:50051", "--ca-dir", str(ca),
            "--out", str(tmp_path / "kits" / "site-c"), "--policy", str(tmp_path / "nope"))
    assert r.returncode != 0 and "cannot read" in r.stderr
    # The kit's node.toml names a policy file the kit must hold.
    (out / "policy.toml").unlink()
    with pytest.raises(ConfigError, match="policy = 'policy.toml'.*not a file"):
        read_node_kit(out)
    doc = (out / "node.toml").read_text().replace('policy = "policy.toml"', "policy = 3")
    (out / "node.toml").write_text(doc)
    with pytest.raises(ConfigError, match="policy must be a string"):
        read_node_kit(out)


def test_node_start_reads_the_kits_policy_unless_given_one(tmp_path: Path) -> None:
    """`node start --kit` checks the kit's policy.toml before it starts (a bad one stops it
    with the file's error); --policy given on the command line wins over the kit's."""
    ca = _ca(tmp_path)
    policy = tmp_path / "p.toml"
    policy.write_text('max_rounds = 5\n')
    out = tmp_path / "site-a"
    data = tmp_path / "no-data-here"
    assert cli("kit", "site", "site-a", "--aggregator", "127.0.0.1:1", "--ca-dir", str(ca),
               "--out", str(out), "--policy", str(policy), "--data", str(data)).returncode == 0
    # The site edits its kit's file (it may): node start reads the edited file.
    (out / "policy.toml").write_text('max_rounds = "many"\n')
    r = cli("node", "start", "--kit", str(out))
    assert r.returncode != 0 and "policy.toml" in r.stderr and "max_rounds" in r.stderr, r.stderr
    good = tmp_path / "good.toml"
    good.write_text('max_rounds = 5\n')
    r = cli("node", "start", "--kit", str(out), "--policy", str(good))
    # Past the policy (it stops at the missing data directory): --policy replaced the kit's.
    assert r.returncode != 0 and "data directory" in r.stderr, r.stderr
    assert f"site policy {good}: max_rounds=5" in r.stderr
