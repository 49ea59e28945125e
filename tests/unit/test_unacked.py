"""A node keeps an update the aggregator has not acknowledged, on disk, to send it again
instead of training again (node/unacked.py; the agent uses it in node/agent.py)."""

from __future__ import annotations

from pathlib import Path

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
