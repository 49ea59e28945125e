"""Tasks a node cannot take, on a real aggregator and a real agent: each is reported to the
aggregator once, as a failed task with its reason, and the agent stays up (issue 12)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedgpu.proto import pb, pb_grpc
from tests.fixtures.federation import FEDGPU, Federation, base_env, free_port, write_job
from tests.integration.test_faults import faulty_env, wait_for

pytestmark = pytest.mark.timeout(300)


def _failures(fed: Federation) -> list[dict]:
    return [f for r in fed.query("ListRounds")["rounds"] for f in r.get("failures", [])]


def test_oversized_task_is_reported_once_per_attempt_not_pulled_forever(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    # Task "big": a 2.4 MB global model. The node builds it (the init task carries no
    # payload), then cannot take it back as round 1's payload under --max-task-mib 1.
    job = write_job(tmp_path / "job.toml", task="big", rounds=1, min_nodes=1,
                    round_deadline_s=120, evaluate=False, round_retries=1)
    federation.start_server(job, "--heartbeat-s", "1")
    node = federation.start_node("node-a", digits_split[0], "--max-task-mib", "1",
                                 "--no-prestart", env=faulty_env(tmp_path, "node-a"))
    status = federation.wait_state(("finished", "failed"), timeout=240)
    assert status["state"] == "failed", status
    rounds = federation.query("ListRounds")["rounds"]
    # round_retries = 1: two attempts of round 1, neither finished.
    assert [(r["round"], r["attempt"]) for r in rounds] == [(1, 1), (1, 2)]
    assert all(r["status"] != "finished" for r in rounds)
    failures = _failures(federation)
    assert len(failures) == 2
    for f in failures:
        assert f["error"].startswith("task payload over this node's limit: ")
        assert "exceed this node's limit of 1048576 bytes" in f["error"]
    # One pull per attempt: reported, not pulled again and again.
    assert node.text().count("task payload over this node's limit") == 2, node.text()[-3000:]
    (me,) = federation.query("ListNodes")["nodes"]
    assert me["rounds_failed"] == 2
    # It stayed up through both, serving the federation after the failed job.
    assert node.popen.poll() is None, node.text()[-2000:]


def _initial_weights(path: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    from fedgpu.node.tasks.digits import DigitsTask

    torch.manual_seed(0)
    model = DigitsTask().build_model({})
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def test_round_that_cannot_start_is_reported_and_the_agent_stays_up(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    # A real OSError in the agent while it starts the round: its file size limit (RLIMIT_FSIZE,
    # which binds root too) is below the size of the round's payload, so writing weights.in
    # fails with EFBIG. The model comes from the job, so no round before it writes a file.
    weights = _initial_weights(tmp_path / "init.safetensors")
    limit = weights.stat().st_size // 2
    job = write_job(tmp_path / "job.toml", task="digits", rounds=1, min_nodes=1,
                    round_deadline_s=120, evaluate=False, round_retries=2,
                    initial_weights=str(weights))
    federation.start_server(job, "--heartbeat-s", "1")
    limited = ("import os, resource, sys; "
               f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
               "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
    log = tmp_path / "node-a.log"
    work = tmp_path / "work"  # where the agent makes each round's directory
    work.mkdir()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-c", limited, *FEDGPU[1:], "node", "start", "--aggregator",
             federation.address, "--data", str(digits_split[0]), "--name", "node-a",
             "--torch-threads", "1", "--status-file", str(tmp_path / "node-a.status"),
             "--gpu", "none"],
            stdout=fh, stderr=subprocess.STDOUT,
            env=base_env(FEDGPU_TOKEN=federation.token, TMPDIR=str(work)))
    try:
        wait_for("the first failure", lambda: _failures(federation), 120, federation)
        first = _failures(federation)[0]
        assert first["error"].startswith("cannot start the round: [Errno 27] File too large")
        # The agent is still up and polling: it takes (and fails) the round's next attempt.
        wait_for("a second attempt's failure", lambda: len(_failures(federation)) >= 2, 120,
                 federation)
        assert proc.poll() is None, log.read_text()[-2000:]
        (me,) = federation.query("ListNodes")["nodes"]
        assert me["state"] != "lost" and me["rounds_failed"] >= 2
        status = federation.wait_state(("finished", "failed"), timeout=120)
        assert status["state"] == "failed"
        # Still serving the federation after the failed job; SIGTERM ends it cleanly.
        assert proc.poll() is None, log.read_text()[-2000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "cannot start round 1" in text and "Traceback" not in text
    # Nothing of the failed rounds is left behind.
    assert list(work.iterdir()) == []


def test_unreachable_aggregator_gives_up_at_the_connect_deadline(tmp_path: Path,
                                                                  digits_split: list[Path]
                                                                  ) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    r = subprocess.run([*FEDGPU, "node", "start", "--aggregator", address, "--data",
                        str(digits_split[0]), "--gpu", "none", "--no-prestart",
                        "--connect-timeout", "4", "--status-file", str(tmp_path / "s.json")],
                       capture_output=True, text=True, env=base_env(FEDGPU_TOKEN="t"),
                       timeout=120)
    elapsed = time.monotonic() - started
    assert r.returncode == 1, r.stderr
    assert f"error: cannot reach aggregator at {address}" in r.stderr
    # Several tries with backoff, and no more than the deadline allows.
    assert r.stderr.count("unreachable; retrying in") >= 2
    assert elapsed >= 4


class DamagingAggregator(pb_grpc.FederationServicer):
    """A real gRPC server that speaks the Federation contract but sends one broken task
    stream first (what fedgpu's own aggregator never sends), then says the run is over."""

    def __init__(self, first: list[pb.TaskChunk]) -> None:
        self.first, self.pulls, self.updates = first, 0, []

    def Register(self, request, context):  # noqa: N802 - gRPC's names
        return pb.RegisterReply(node_id="node-x", run_id="run", heartbeat_interval_s=1)

    def Heartbeat(self, request, context):  # noqa: N802
        return pb.HeartbeatReply(known=True)

    def PullTask(self, request, context):  # noqa: N802
        self.pulls += 1
        if self.pulls == 1:
            yield from self.first
            return
        yield pb.TaskChunk(header=pb.TaskHeader(kind=pb.TASK_KIND_SHUTDOWN, message="done"))

    def PushUpdate(self, request_iterator, context):  # noqa: N802
        self.updates.extend(c.header for c in request_iterator if c.HasField("header"))
        return pb.PushReply(accepted=True, message="failure recorded")


TRAIN = pb.TaskHeader(task_id="t1", round=1, kind=pb.TASK_KIND_TRAIN, task_name="digits",
                      payload_size=8, payload_sha256="00" * 32)


@pytest.mark.parametrize("stream,reported", [
    ([pb.TaskChunk(header=TRAIN), pb.TaskChunk(data=b"12345678")], True),
    ([pb.TaskChunk(data=b"12345678")], False),
], ids=["damaged-payload", "no-header"])
def test_a_broken_task_stream_is_reported_or_asked_again_never_looped(
        tmp_path: Path, digits_split: list[Path], stream: list[pb.TaskChunk],
        reported: bool) -> None:
    from concurrent import futures

    import grpc

    servicer = DamagingAggregator(stream)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_FederationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        r = subprocess.run([*FEDGPU, "node", "start", "--aggregator", f"127.0.0.1:{port}",
                            "--data", str(digits_split[0]), "--gpu", "none", "--insecure",
                            "--no-prestart", "--status-file", str(tmp_path / "s.json")],
                           capture_output=True, text=True, env=base_env(), timeout=120)
    finally:
        server.stop(0)
    assert r.returncode == 0, r.stderr[-2000:]
    # Asked once more, then told the run is over: no loop either way.
    assert servicer.pulls == 2
    if reported:
        # The same task would come back just as broken: the aggregator hears why, once.
        (update,) = servicer.updates
        assert update.failed and update.task_id == "t1" and update.round == 1
        assert update.error.startswith("task payload damaged: ")
        assert "sha256 mismatch" in update.error, update.error
    else:
        # Nothing said what the stream carried: nothing to report; asked again after a wait.
        assert servicer.updates == []
        assert "broken task stream (weight chunk before the task header); asking again in" \
            in r.stderr
