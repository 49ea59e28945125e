"""fedgpu.node.data.check_data_dir: the agent's start-up check of its mounted data directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedgpu.core.datasets import read_meta, split_digits
from fedgpu.node.data import DataDirError, check_data_dir, read_split, train_examples


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("split")
    split_digits(root, 2)
    return root


def test_a_node_dir_passes(split: Path) -> None:
    check_data_dir(split / "node-1")
    assert set(read_split(split / "node-1", "train.safetensors")) == {"x", "y"}


def test_missing_dir_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(DataDirError, match="does not exist: make per-node partitions with "
                       "'fedgpu data split --out DIR --nodes N'"):
        check_data_dir(tmp_path / "nope")


def test_the_split_root_points_at_a_node_dir(split: Path) -> None:
    with pytest.raises(DataDirError, match="node-1, node-2, not one node's data") as info:
        check_data_dir(split)
    assert str(split / "node-1") in str(info.value)


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(DataDirError, match="has no train.safetensors, test.safetensors.*"
                       "fedgpu data split"):
        check_data_dir(tmp_path)


def test_a_corrupt_file_is_caught_at_start_up(split: Path, tmp_path: Path) -> None:
    for name in ("train.safetensors", "test.safetensors"):
        (tmp_path / name).write_bytes((split / "node-1" / name).read_bytes())
    (tmp_path / "test.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(DataDirError, match="test.safetensors is not a valid safetensors file"):
        check_data_dir(tmp_path)


def test_it_is_a_value_error_for_callers_that_catch_those(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        check_data_dir(tmp_path / "nope")


def test_an_image_folder_passes(tmp_path: Path) -> None:
    from fedgpu.core.synth_images import synth_images

    node = synth_images(tmp_path / "img", 1, classes=2, per_class=3, size=8)[0]
    check_data_dir(node)
    (node / "test").rename(node / "held-out")
    with pytest.raises(DataDirError, match="an image task needs train/ and test/ folders"):
        check_data_dir(node)


def test_the_training_set_size_is_read_from_the_header(split: Path, tmp_path: Path) -> None:
    # What the agent states at registration; the aggregator refuses claims above it.
    for node in ("node-1", "node-2"):
        assert train_examples(split / node) == read_meta(split / node)["num_train"] > 0
    assert train_examples(tmp_path / "nope") == 0  # cannot tell: the first update states it
    (tmp_path / "train.safetensors").write_bytes(b"garbage")
    assert train_examples(tmp_path) == 0
