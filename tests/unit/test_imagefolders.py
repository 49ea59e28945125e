"""Per-node image folders: synthetic images, partitions of a real folder, and the CLI for both."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedgpu.core.imagefolders import (
    ImageFolderError,
    list_images,
    node_classes,
    scan_source,
    split_folder,
)
from fedgpu.core.synth_images import class_colours, render, synth_images
from tests.fixtures.federation import cli


def _files(node_dir: Path, split: str) -> dict[str, list[str]]:
    folders = sorted((node_dir / split).iterdir())
    return {d.name: sorted(p.name for p in d.iterdir()) for d in folders}


def test_synth_images_writes_the_per_node_layout(tmp_path: Path) -> None:
    dirs = synth_images(tmp_path / "d", 2, classes=3, per_class=10, size=12, seed=4)
    assert [d.name for d in dirs] == ["node-1", "node-2"]
    for d in dirs:
        meta = json.loads((d / "meta.json").read_text())
        assert meta["classes"] == ["class-0", "class-1", "class-2"] == node_classes(d)
        assert meta["num_train"] == 24 and meta["num_test"] == 6
        assert meta["class_histogram"] == {"train": [8, 8, 8], "test": [2, 2, 2]}
        assert {k: len(v) for k, v in _files(d, "train").items()} == {
            "class-0": 8, "class-1": 8, "class-2": 8}
        img = Image.open(d / "test" / "class-1" / "000000.png")
        assert img.size == (12, 12) and img.mode == "RGB"
    # Same distribution on every node, different images.
    a = (dirs[0] / "train" / "class-0" / "000005.png").read_bytes()
    b = (dirs[1] / "train" / "class-0" / "000005.png").read_bytes()
    assert a != b


def test_synth_images_depend_on_the_seed_alone(tmp_path: Path) -> None:
    def one(name: str, seed: int) -> bytes:
        d = synth_images(tmp_path / name, 1, classes=2, per_class=4, size=8, seed=seed)[0]
        return (d / "train" / "class-1" / "000003.png").read_bytes()

    assert one("a", 1) == one("b", 1) != one("c", 2)


def test_synthetic_classes_differ_by_more_than_their_noise() -> None:
    # Mean images of two classes are far apart compared with the spread within one: learnable.
    rng = np.random.default_rng(0)
    colours = class_colours(10, seed=0)
    means = [np.mean([render(c, colours, 32, rng) for _ in range(50)], axis=0) for c in (0, 1)]
    within = np.mean([np.abs(render(0, colours, 32, rng) - means[0]).mean() for _ in range(20)])
    assert np.abs(means[0] - means[1]).mean() > within


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"classes": 1}, "--classes must be between 2 and"),
    ({"per_class": 1}, "--per-class must be between 2 and"),
    ({"size": 4}, "--size must be between 8 and 512"),
    ({"test_fraction": 1.0}, "test_fraction must be between 0 and 1"),
])
def test_synth_images_refuses_bad_arguments(tmp_path: Path, kwargs: dict[str, float],
                                            needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        synth_images(tmp_path / "x", 1, **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "x").exists()


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A CIFAR-style export: SRC/train/<class>/ and SRC/test/<class>/ with clashing names."""
    src = tmp_path / "src"
    for split, n in (("train", 12), ("test", 3)):
        for c, name in enumerate(["cat", "dog", "frog"]):
            (src / split / name).mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (4, 4), (c * 80, i, 0)).save(src / split / name / f"{i}.png")
    (src / "train" / "cat" / "notes.txt").write_text("not an image")
    return src


def test_split_folder_covers_every_image_once_with_the_same_labels(
    source: Path, tmp_path: Path
) -> None:
    paths, labels, classes = scan_source(source)
    assert classes == ["cat", "dog", "frog"] and len(paths) == 45
    dirs = split_folder(source, tmp_path / "out", 3, partition="dirichlet", alpha=0.3, seed=2)
    seen: list[tuple[str, str]] = []
    for d in dirs:
        assert node_classes(d) == classes  # every node lists every class
        meta = json.loads((d / "meta.json").read_text())
        for split in ("train", "test"):
            items = list_images(d / split, classes)
            assert len(items) == meta[f"num_{split}"]
            for path, label in items:
                # The original file, linked: same bytes, under the same class name.
                index = int(path.name.split("-", 1)[0])
                assert paths[index].read_bytes() == path.read_bytes()
                assert classes[label] == paths[index].parent.name
                assert path.stat().st_ino == paths[index].stat().st_ino
                seen.append((split, str(paths[index])))
        assert meta["num_test"] >= 1 and meta["num_train"] >= 1
    assert sorted(p for _, p in seen) == sorted(str(p) for p in paths)


def test_split_folder_refuses_what_is_not_an_image_folder(tmp_path: Path) -> None:
    (tmp_path / "flat").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "flat" / "a.png")
    with pytest.raises(ImageFolderError, match="has no class folders"):
        split_folder(tmp_path / "flat", tmp_path / "o", 2)
    (tmp_path / "empty" / "cat").mkdir(parents=True)
    with pytest.raises(ImageFolderError, match="holds no images"):
        split_folder(tmp_path / "empty", tmp_path / "o", 2)


def test_node_layout_errors_name_the_folder(tmp_path: Path) -> None:
    node = synth_images(tmp_path / "d", 1, classes=2, per_class=4, size=8)[0]
    (node / "train" / "class-9").mkdir()
    with pytest.raises(ImageFolderError, match=r"class folder\(s\) class-9 that are not among"):
        list_images(node / "train", node_classes(node))
    with pytest.raises(ImageFolderError, match="does not exist: a node's image folder needs"):
        list_images(tmp_path / "nowhere", ["a"])
    (node / "meta.json").unlink()  # then the classes come from the folders
    assert node_classes(node) == ["class-0", "class-1", "class-9"]
    with pytest.raises(ImageFolderError, match="has no class folders under train/ or test/"):
        node_classes(tmp_path)


def test_cli_writes_and_splits_image_folders(tmp_path: Path) -> None:
    made = cli("data", "synth-images", "--out", str(tmp_path / "s"), "--nodes", "2",
               "--classes", "3", "--per-class", "12", "--size", "8")
    assert made.returncode == 0, made.stderr
    assert made.stdout.split() == [str(tmp_path / "s" / "node-1"), str(tmp_path / "s" / "node-2")]
    assert "node-1: 30 train / 6 test" in made.stderr
    split = cli("data", "split-folder", str(tmp_path / "s" / "node-1"), "--out",
                str(tmp_path / "p"), "--nodes", "3")
    assert split.returncode == 0, split.stderr
    assert len(split.stdout.split()) == 3
    again = cli("data", "synth-images", "--out", str(tmp_path / "s"), "--nodes", "2")
    assert again.returncode == 2 and "exists and is not empty; pass --force" in again.stderr
    bad = cli("data", "split-folder", str(tmp_path / "none"), "--out", str(tmp_path / "q"),
              "--nodes", "2")
    assert bad.returncode == 2 and "is not a directory" in bad.stderr
