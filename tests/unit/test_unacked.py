"""A node keeps an update the aggregator has not acknowledged, on disk, to send it again
instead of training again (node/unacked.py; the agent uses it in node/agent.py)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from fedgpu.core import digests
from fedgpu.node.unacked import MAX_KEPT, UnackedUpdates
from fedgpu.proto import pb


def _update(tmp: Path, task_id: str) -> tuple[pb.UpdateHeader, Path]:
    weights = tmp / f"work-{task_id}" / "weights.safetensors"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"weights of " + task_id.encode())
    return pb.UpdateHeader(task_id=task_id, round=3, num_examples=7), weights


def test_a_kept_update_survives_its_work_folder_and_a_restart(tmp_path: Path) -> None:
    header, weights = _update(tmp_path, "abc123")
    UnackedUpdates(tmp_path / "state").keep(header, weights)
    # The round's work folder is removed after the round: the weights were moved out of it.
    assert not weights.exists()
    kept = UnackedUpdates(tmp_path / "state").take("abc123")  # a new agent process
    assert kept is not None and kept.header == header
    assert kept.weights is not None and kept.weights.read_bytes() == b"weights of abc123"
    assert UnackedUpdates(tmp_path / "state").take("other") is None


def test_an_acknowledged_update_is_let_go_and_left_overs_are_bounded(tmp_path: Path) -> None:
    store = UnackedUpdates(tmp_path / "state")
    header, weights = _update(tmp_path, "t0")
    store.keep(header, weights)
    store.drop("t0")
    assert store.take("t0") is None and not list((tmp_path / "state").iterdir())
    for i in range(MAX_KEPT + 3):
        store.keep(*_update(tmp_path, f"t{i + 1}"))
    assert len(list((tmp_path / "state").glob("*.header"))) <= MAX_KEPT
    assert store.take(f"t{MAX_KEPT + 3}") is not None


def test_a_task_id_cannot_name_a_path_outside_the_folder(tmp_path: Path) -> None:
    store = UnackedUpdates(tmp_path / "state")
    store.keep(pb.UpdateHeader(task_id="../../escape", round=1), None)
    assert not (tmp_path / "escape.header").exists()
    assert all(p.parent == tmp_path / "state" for p in (tmp_path / "state").iterdir())


def _task(task_id: str, rnd: int, model: str, job: str = "job-1") -> pb.TaskHeader:
    task = pb.TaskHeader(task_id=task_id, round=rnd, kind=pb.TASK_KIND_TRAIN)
    task.job_terms.job_id = job
    digests.stamp(task, digests.DigestAlgo.BLAKE3, model)
    return task


def test_an_acknowledged_update_stays_for_the_same_task_and_the_same_model(
        tmp_path: Path) -> None:
    # An aggregator killed before its round closed asks for it again (server/rounds/reopen.py).
    store = UnackedUpdates(tmp_path / "state")
    header, weights = _update(tmp_path, "t1")
    store.keep(header, weights, _task("t1", 3, "aa" * 32), acked=True)
    kept = store.take(_task("t1", 3, "aa" * 32))
    assert kept is not None and kept.acked and kept.weights is not None
    # The same task id with another model is no answer to it: dropped, the node trains.
    assert store.take(_task("t1", 3, "bb" * 32)) is None
    assert store.take("t1") is None


def test_a_new_attempt_of_the_same_job_drops_what_was_kept_for_the_old_one(
        tmp_path: Path) -> None:
    store = UnackedUpdates(tmp_path / "state")
    store.keep(*_update(tmp_path, "old"), _task("old", 3, "aa" * 32))
    store.keep(*_update(tmp_path, "other-job"), _task("other-job", 3, "aa" * 32, job="job-2"))
    store.keep(*_update(tmp_path, "later"), _task("later", 5, "aa" * 32))
    dropped = store.moved_on(_task("new", 4, "cc" * 32))
    assert dropped == [("old", 3)]
    assert store.take("old") is None
    assert store.take("other-job") is not None and store.take("later") is not None


def test_an_acknowledged_update_on_another_file_system_is_not_copied(tmp_path: Path) -> None:
    # /dev/shm is a tmpfs: another device than the test's folder on most machines.
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        import pytest
        pytest.skip("no second file system here")
    weights = Path(tempfile.mkdtemp(dir=shm)) / "weights.safetensors"
    weights.write_bytes(b"w")
    store = UnackedUpdates(tmp_path / "state")
    store.keep(pb.UpdateHeader(task_id="t1", round=1), weights, _task("t1", 1, "aa" * 32),
               acked=True)
    assert store.take("t1") is None and weights.exists()  # left where it was, not copied
    shutil.rmtree(weights.parent)
