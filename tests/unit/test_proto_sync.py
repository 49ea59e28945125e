"""The committed generated code is exactly what the .proto files generate."""

from __future__ import annotations

from pathlib import Path

from fedgpu.proto.generate import PROTO_DIR, ROOT, generate, proto_files


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    generate(tmp_path)
    rel = PROTO_DIR.relative_to(ROOT)
    produced = sorted(p.name for p in (tmp_path / rel).iterdir())
    assert produced, "protoc produced nothing"
    for name in produced:
        committed = PROTO_DIR / name
        assert committed.exists(), f"{name} is not committed: run make proto"
        assert committed.read_text() == (tmp_path / rel / name).read_text(), (
            f"{committed} differs from its .proto: run make proto and commit")
    stems = {p.stem for p in proto_files()}
    assert stems == {"federation", "admin"}
    for stem in stems:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert (PROTO_DIR / f"{stem}{suffix}").exists()
