"""TLS material and checkpoints without a server: what the files promise."""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path

import blake3
import numpy as np
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from fedgpu.core import certs
from fedgpu.core.errors import ConfigError
from fedgpu.core.job import parse_job
from fedgpu.server.jobs import resume
from fedgpu.server.rounds.checkpoint import Checkpointer, CheckpointError


def test_issued_certs_chain_to_the_ca_and_carry_names(tmp_path: Path) -> None:
    ca_path = certs.init_ca(tmp_path)
    server = certs.issue_server(tmp_path, sans=["agg.example", "10.0.0.7"])
    node = certs.issue_node(tmp_path, "site-3")
    ca = x509.load_pem_x509_certificate(ca_path.read_bytes())
    for issued in (server, node):
        cert = x509.load_pem_x509_certificate(issued.cert.read_bytes())
        cert.verify_directly_issued_by(ca)
        assert stat.S_IMODE(issued.key.stat().st_mode) == 0o600
        assert issued.ca.read_bytes() == ca_path.read_bytes()
    srv = x509.load_pem_x509_certificate(server.cert.read_bytes())
    sans = srv.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "agg.example" in sans.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    eku = x509.load_pem_x509_certificate(node.cert.read_bytes()).extensions \
        .get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]  # a node cert cannot serve
    assert certs.identity(node.cert.read_bytes()) == "site-3"
    with pytest.raises(ConfigError, match="already exist"):
        certs.init_ca(tmp_path)
    with pytest.raises(ConfigError, match="fedgpu certs init"):
        certs.issue_node(tmp_path / "elsewhere", "x")


def _job(**kw: object):  # type: ignore[no-untyped-def]
    return parse_job({"task": "digits", **kw})


def test_checkpoint_round_trip_and_commit_point(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path)
    w1 = {"w": np.arange(4, dtype=np.float32)}
    ck.save(w1, {"run_id": "r", "global_round": 1, "job": _job().to_dict()})
    w2 = {"w": np.arange(4, dtype=np.float32) * 2}
    ck.save(w2, {"run_id": "r", "global_round": 2, "job": _job().to_dict()})
    loaded = ck.load()
    assert loaded is not None
    assert np.array_equal(loaded[0]["w"], w2["w"]) and loaded[1]["global_round"] == 2
    # The state names its digest; the weights come back as read-only views of the file.
    assert loaded[1]["weights_digest_algorithm"] == "blake3-segments"
    raw = (tmp_path / "global-000002.safetensors").read_bytes()
    assert loaded[1]["weights_digest"] == blake3.blake3(blake3.blake3(raw).digest()).hexdigest()
    assert not loaded[0]["w"].flags.writeable
    # Only the committed round's weights are kept, and the stable name is the same file.
    assert sorted(p.name for p in tmp_path.glob("global*.safetensors")) == [
        "global-000002.safetensors", "global.safetensors"]
    assert (tmp_path / "global.safetensors").samefile(tmp_path / "global-000002.safetensors")
    # A crash after writing round 3's weights but before its state.json: round 2 still loads.
    (tmp_path / "global-000003.safetensors").write_bytes(b"half-written")
    again = ck.load()
    assert again is not None and again[1]["global_round"] == 2
    # Damaged weights are named, not loaded.
    (tmp_path / "global-000002.safetensors").write_bytes(b"x" * 8)
    with pytest.raises(CheckpointError, match="do not match the blake3"):
        ck.load()


def test_a_checkpoint_that_names_a_sha256_still_loads(tmp_path: Path) -> None:
    # state.json from before BLAKE3: `weights_sha256`, no algorithm named.
    ck = Checkpointer(tmp_path)
    ck.save({"w": np.arange(3, dtype=np.float32)}, {"run_id": "r", "global_round": 1})
    state = json.loads((tmp_path / "state.json").read_text())
    blob = (tmp_path / state["weights_file"]).read_bytes()
    del state["weights_digest"], state["weights_digest_algorithm"]
    state["weights_sha256"] = hashlib.sha256(blob).hexdigest()
    (tmp_path / "state.json").write_text(json.dumps(state))
    loaded = ck.load()
    assert loaded is not None and np.array_equal(loaded[0]["w"], np.arange(3))
    # ... and its digest is checked: a flipped byte is named.
    (tmp_path / state["weights_file"]).write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="do not match the sha256"):
        ck.load()


def test_a_checkpoint_that_names_plain_blake3_still_loads(tmp_path: Path) -> None:
    # state.json from before BLAKE3_SEGMENTS: checked with the algorithm it names, and its
    # weights are not served under that digest (saved() is None: they are encoded again).
    ck = Checkpointer(tmp_path)
    ck.save({"w": np.arange(3, dtype=np.float32)}, {"run_id": "r", "global_round": 1})
    state = json.loads((tmp_path / "state.json").read_text())
    blob = (tmp_path / state["weights_file"]).read_bytes()
    state["weights_digest_algorithm"] = "blake3"
    state["weights_digest"] = blake3.blake3(blob).hexdigest()
    (tmp_path / "state.json").write_text(json.dumps(state))
    loaded = ck.load()
    assert loaded is not None and np.array_equal(loaded[0]["w"], np.arange(3))
    assert ck.saved(loaded[1]) is None
    (tmp_path / state["weights_file"]).write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="do not match the blake3"):
        ck.load()


def test_resume_refuses_another_job(tmp_path: Path) -> None:
    weights = {"w": np.zeros(3, np.float32)}
    state = json.loads(json.dumps({"run_id": "r", "global_round": 2,
                                   "job": _job(strategy="fedavg").to_dict()}))
    resume.check(_job(rounds=9, round_deadline_s=5), weights, state, None, tmp_path)  # ok
    with pytest.raises(ConfigError, match="task = 'digits', but this job has task = 'other'"):
        resume.check(_job(task="other"), weights, state, None, tmp_path)
    with pytest.raises(ConfigError, match="tensor names, shapes or dtypes differ"):
        resume.check(_job(), weights, state, {"w": np.zeros(4, np.float32)}, tmp_path)
    with pytest.raises(ConfigError, match="only 1 rounds"):
        resume.check(_job(rounds=1), weights, state, None, tmp_path)
    with pytest.raises(ConfigError, match="not a fedgpu checkpoint"):
        resume.check(_job(), weights, {"what": 1}, None, tmp_path)


def test_an_unchanged_model_is_not_written_again(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path)
    state = {"run_id": "r", "global_round": 3, "job": _job().to_dict()}
    saved = ck.save({"w": np.arange(6, dtype=np.float32)}, state)
    before = saved.path.stat()
    mapped = ck.load()
    assert mapped is not None
    # The run's last commit (its final evaluation): the same round, the same weights.
    again = ck.save(mapped[0], {**state, "completed": True}, same_as=saved)
    after = again.path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert (again.digest, again.size) == (saved.digest, saved.size)
    loaded = ck.load()
    assert loaded is not None and loaded[1]["completed"] is True
    assert loaded[1]["weights_digest"] == saved.digest
    assert np.array_equal(loaded[0]["w"], np.arange(6, dtype=np.float32))
    # A file of another round is no reason to skip the write: round 4's weights are written.
    state4 = {**state, "global_round": 4}
    fresh = ck.save({"w": np.ones(6, dtype=np.float32)}, state4, same_as=saved)
    assert fresh.path.name == "global-000004.safetensors" and fresh.digest != saved.digest
    assert not saved.path.exists()
