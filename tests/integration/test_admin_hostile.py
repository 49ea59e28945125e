"""A hostile operator against a real aggregator (issue 24): every Admin call answers a named
status with a bounded message, never UNKNOWN, and the aggregator keeps serving (health
checks answer) whatever job file, bundle, initial weights or job id it was sent.

An operator is trusted to run jobs, not to crash, freeze or exhaust the aggregator: each case
below did one of those before (MemoryError, RecursionError, tarfile.ReadError reaching the
caller as UNKNOWN; a FIFO read on the event loop; /etc/passwd in an error; ids of megabytes
echoed whole; a queue without a limit).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from fedgpu.core import admin_client, codec
from fedgpu.core.bundles import pack_files
from fedgpu.core.transport import token_metadata
from fedgpu.proto import admin_pb2, admin_pb2_grpc
from tests.fixtures.federation import OPERATOR_TOKEN, Federation, cli

MANIFEST = b'name = "demo"\nentry = "demo_task.model:DemoTask"\n'
MODEL = b"class DemoTask:\n    pass\n"
# What any Admin error may carry at most (server/admin_guard.py MAX_DETAIL, plus its marker).
MAX_DETAILS = 2100
MAX_QUEUED = 4


@dataclass
class Hostile:
    fed: Federation
    stub: admin_pb2_grpc.AdminStub
    state_dir: Path
    serving: Path

    def submit(self, job_toml: str, bundle: bytes | None = None,
               weights: bytes | None = None, **header: object) -> admin_pb2.JsonReply:
        head = admin_pb2.SubmitJobHeader(job_toml=job_toml, filename="hostile.toml")
        chunks = []
        if bundle is not None:
            head.bundle_size = len(bundle)
            head.bundle_sha256 = hashlib.sha256(bundle).hexdigest()
            chunks.append(bundle)
        if weights is not None:
            head.initial_weights_size = len(weights)
            head.initial_weights_sha256 = hashlib.sha256(weights).hexdigest()
            chunks.append(weights)
        for key, value in header.items():
            setattr(head, key, value)
        messages = [admin_pb2.SubmitJobChunk(header=head)]
        for data in chunks:
            messages += [admin_pb2.SubmitJobChunk(data=data[i:i + (1 << 20)])
                         for i in range(0, len(data), 1 << 20)]
        return self.stub.SubmitJob(iter(messages), metadata=token_metadata(OPERATOR_TOKEN),
                                   timeout=60)

    def refused(self, call: object, *codes: grpc.StatusCode) -> grpc.RpcError:
        """Run `call` (a no-argument function); it must fail with one of `codes`."""
        with pytest.raises(grpc.RpcError) as err:
            call()  # type: ignore[operator]
        code = err.value.code()
        assert code is not grpc.StatusCode.UNKNOWN, err.value.details()
        assert code in codes, (code, err.value.details()[:300])
        assert len(err.value.details()) <= MAX_DETAILS
        assert self.healthy()
        return err.value

    def healthy(self) -> bool:
        return admin_client.health(self.fed.address, timeout=5) == "SERVING"


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    tmp = tmp_path_factory.mktemp("hostile")
    serving = tmp / "models"
    serving.mkdir()
    (serving / "base.safetensors").write_bytes(codec.encode({"w": _ones()}).to_bytes())
    os.mkfifo(serving / "fifo.safetensors")
    fed = Federation(tmp)
    try:
        fed.start_server(None, "--state-dir", str(tmp / "state"), "--max-queued-jobs",
                         str(MAX_QUEUED), "--initial-weights-dir", str(serving),
                         "--max-update-mib", "1")
        with grpc.insecure_channel(fed.address) as ch:
            yield Hostile(fed, admin_pb2_grpc.AdminStub(ch), tmp / "state", serving)
    finally:
        fed.stop()


def _ones() -> object:
    import numpy as np

    return np.ones((4, 4), np.float32)


def _tar(members: dict[str, bytes], fmt: int = tarfile.USTAR_FORMAT,
         pax: dict[str, dict[str, str]] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in sorted(members.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            if pax and name in pax:
                info.pax_headers = pax[name]
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _pax_header_claiming_a_gibibyte() -> bytes:
    info = tarfile.TarInfo("././@PaxHeader")
    info.type = tarfile.XHDTYPE
    info.size = 1 << 30
    return info.tobuf(format=tarfile.USTAR_FORMAT) + \
        b"30 path=demo_task/model.py\n".ljust(512, b"\0") + \
        pack_files({"fedgpu-task.toml": MANIFEST, "demo_task/model.py": MODEL})


BAD_JOBS = {
    "min_nodes = 10**9": 'task = "digits"\nmin_nodes = 1000000000\n',
    "rounds = 10**20": 'task = "digits"\nrounds = 100000000000000000000\n',
    "seed = 2**63": 'task = "digits"\nseed = 9223372036854775808\n',
    "seed of 5,000 digits": 'task = "digits"\nseed = ' + "9" * 5000 + "\n",
    "nested 20,000 deep": 'task = "digits"\nx = ' + "[" * 20_000 + "]" * 20_000 + "\n",
    "deadline of 1e300 s": 'task = "digits"\nround_deadline_s = 1e300\n',
    "ring of 5,000 nodes": 'task = "digits"\nmode = "ring"\nmin_nodes = 5000\n',
}


@pytest.mark.parametrize("case", sorted(BAD_JOBS))
def test_bad_job_files_are_invalid_argument(hostile: Hostile, case: str) -> None:
    err = hostile.refused(lambda: hostile.submit(BAD_JOBS[case]),
                          grpc.StatusCode.INVALID_ARGUMENT)
    assert "hostile.toml" in err.details()


BAD_BUNDLES = {
    "pax header claiming 1 GiB": _pax_header_claiming_a_gibibyte(),
    "pax size past the archive": _tar({"fedgpu-task.toml": MANIFEST,
                                       "demo_task/model.py": MODEL}, tarfile.PAX_FORMAT,
                                      {"demo_task/model.py": {"size": str(1 << 30)}}),
    "manifest nested 20,000 deep": pack_files({
        "fedgpu-task.toml": b"x = " + b"[" * 20_000 + b"]" * 20_000 + b"\n",
        "demo_task/model.py": MODEL}),
    "4 MB entry module": pack_files({
        "fedgpu-task.toml": MANIFEST,
        "demo_task/model.py": MODEL + b"x = " + b"1+" * (2 << 20) + b"1\n"}),
}


@pytest.mark.parametrize("case", sorted(BAD_BUNDLES))
def test_bad_bundles_are_invalid_argument(hostile: Hostile, case: str) -> None:
    err = hostile.refused(lambda: hostile.submit('rounds = 1\n', bundle=BAD_BUNDLES[case]),
                          grpc.StatusCode.INVALID_ARGUMENT)
    assert "task bundle refused" in err.details()


@pytest.mark.parametrize("size", [100_000, 4 << 20])
def test_huge_job_ids_are_not_echoed(hostile: Hostile, size: int) -> None:
    job_id = "a" * size
    md = token_metadata(OPERATOR_TOKEN)
    calls = [
        lambda: hostile.stub.GetJob(admin_pb2.GetJobRequest(job_id=job_id), metadata=md,
                                    timeout=30),
        lambda: hostile.stub.StopJob(admin_pb2.StopJobRequest(job_id=job_id), metadata=md,
                                     timeout=30),
        lambda: hostile.stub.GetStatus(admin_pb2.GetStatusRequest(job_id=job_id),
                                       metadata=md, timeout=30),
        lambda: hostile.stub.ListRounds(admin_pb2.ListRoundsRequest(job_id=job_id),
                                        metadata=md, timeout=30),
        lambda: list(hostile.stub.JobLogs(admin_pb2.JobLogsRequest(job_id=job_id),
                                          metadata=md, timeout=30)),
        lambda: list(hostile.stub.DownloadModel(
            admin_pb2.DownloadModelRequest(job_id=job_id), metadata=md, timeout=30)),
    ]
    for call in calls:
        err = hostile.refused(call, grpc.StatusCode.NOT_FOUND,
                              grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert len(err.details()) < 300


def test_initial_weights_name_no_file_outside_the_serving_directory(hostile: Hostile) -> None:
    details = {}
    for name in ("/etc/passwd", "../../../../etc/passwd", "missing.safetensors",
                 "fifo.safetensors", "/dev/zero"):
        started = time.monotonic()
        err = hostile.refused(
            lambda name=name: hostile.submit(f'task = "digits"\ninitial_weights = "{name}"\n'),
            grpc.StatusCode.INVALID_ARGUMENT)
        assert time.monotonic() - started < 10  # nothing blocks on a FIFO or /dev/zero
        assert "root:" not in err.details()
        details[name] = err.details().replace(repr(name), "NAME")
    # One answer whatever the file: no oracle of what exists on the aggregator's host.
    assert len(set(details.values())) == 1, details


def test_initial_weights_over_the_update_limit_are_refused_from_the_header(
        hostile: Hostile) -> None:
    err = hostile.refused(lambda: hostile.submit('task = "digits"\n', weights=b"\0" * 16,
                                                 initial_weights_size=2 << 20),
                          grpc.StatusCode.INVALID_ARGUMENT)
    assert "limit is 1048576 bytes" in err.details()
    hostile.refused(lambda: hostile.submit('task = "digits"\n', weights=b"not safetensors"),
                    grpc.StatusCode.INVALID_ARGUMENT)
    assert not list((hostile.state_dir / ".incoming").iterdir())


def test_accepted_jobs_then_the_queue_limit(hostile: Hostile, tmp_path: Path) -> None:
    # Big numbers that fit, a star job of 30,000 nodes (no mixing matrix), weights from the
    # serving directory: all queued at once.
    for job in ('task = "digits"\nseed = 10000000000000\n',
                'task = "digits"\nmin_nodes = 30000\n',
                'task = "digits"\ninitial_weights = "base.safetensors"\n'):
        started = time.monotonic()
        hostile.submit(job)
        assert time.monotonic() - started < 10
    # `fedgpu job submit` uploads the file the job names (relative to the job file).
    (tmp_path / "w.safetensors").write_bytes(codec.encode({"w": _ones()}).to_bytes())
    (tmp_path / "job.toml").write_text('task = "digits"\ninitial_weights = "w.safetensors"\n')
    r = cli("job", "submit", str(tmp_path / "job.toml"), "--address", hostile.fed.address,
            "--json")
    assert r.returncode == 0, r.stderr
    job_id = json.loads(r.stdout)["job_id"]
    assert (hostile.state_dir / "jobs" / job_id / "initial.safetensors").is_file()
    # --weights-on-aggregator: the name is one of the aggregator's --initial-weights-dir.
    (tmp_path / "served.toml").write_text('task = "digits"\n'
                                          'initial_weights = "base.safetensors"\n')
    r = cli("job", "submit", str(tmp_path / "served.toml"), "--weights-on-aggregator",
            "--address", hostile.fed.address, "--json")
    assert r.returncode == 0, r.stderr
    served = hostile.state_dir / "jobs" / json.loads(r.stdout)["job_id"] / "initial.safetensors"
    assert served.read_bytes() == (hostile.serving / "base.safetensors").read_bytes()
    # Past --max-queued-jobs: a clear refusal, and nothing queued.
    for _ in range(MAX_QUEUED + 1):
        try:
            hostile.submit('task = "digits"\n')
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"--max-queued-jobs {MAX_QUEUED}" in exc.details()
            break
    else:
        raise AssertionError("the queue took more than its limit")
    assert hostile.healthy()
