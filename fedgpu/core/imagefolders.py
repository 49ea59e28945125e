"""Per-node image folders: the layout the `images` task reads, and partitions of a real folder.

One node's data directory:

    node-K/
      meta.json               {"dataset": ..., "classes": ["airplane", ...], ...}
      train/<class>/*.png     training images (PNG or JPEG), one folder per class
      test/<class>/*.png      this node's held-out images, same classes

Every node of a split has a folder for every class (empty where its share holds none) and lists
them in meta.json, so class K is the same label on every node even when a Dirichlet partition
left a node without some classes. Without meta.json, the classes are the sorted union of the
class folders in train/ and test/.

No torch here (core); Pillow is needed only by `synth_images` (fedgpu/core/synth_images.py)
and by the task that decodes the files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from fedgpu.core.datasets import (
    META_FILE,
    NODE_DIR_PREFIX,
    Partition,
    holdout_cut,
    partition_indices,
    remove_old_splits,
    validate_split_args,
)

TRAIN_DIR = "train"
TEST_DIR = "test"
SPLIT_DIRS = (TRAIN_DIR, TEST_DIR)
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg"})
# More classes than this is a folder of something else (a flat folder of images, say).
MAX_CLASSES = 10_000


class ImageFolderError(ValueError):
    """A folder that does not have the image-folder layout, named with what is wrong."""


def is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES and path.is_file()


def node_classes(node_dir: Path) -> list[str]:
    """The class names of a node directory, in label order."""
    node_dir = Path(node_dir)
    meta = node_dir / META_FILE
    if meta.is_file():
        try:
            classes = json.loads(meta.read_text()).get("classes")
        except (OSError, ValueError, AttributeError) as exc:
            raise ImageFolderError(f"{meta} is not a readable JSON object: {exc}") from None
        if classes is not None:
            if not (isinstance(classes, list) and classes
                    and all(isinstance(c, str) and c for c in classes)
                    and len(set(classes)) == len(classes)):
                raise ImageFolderError(f"{meta}: 'classes' must be a list of distinct names")
            return classes
    found: set[str] = set()
    for split in SPLIT_DIRS:
        if (node_dir / split).is_dir():
            found.update(d.name for d in (node_dir / split).iterdir() if d.is_dir())
    if not found:
        raise ImageFolderError(
            f"{node_dir} has no class folders under {TRAIN_DIR}/ or {TEST_DIR}/: expected "
            f"{node_dir}/{TRAIN_DIR}/<class>/*.png; make a split with 'fedgpu data synth-images' "
            f"or 'fedgpu data split-folder'"
        )
    return sorted(found)


def list_images(split_dir: Path, classes: list[str]) -> list[tuple[Path, int]]:
    """(file, label) for every image under split_dir/<class>/, in a fixed order."""
    split_dir = Path(split_dir)
    if not split_dir.is_dir():
        raise ImageFolderError(
            f"{split_dir} does not exist: a node's image folder needs {TRAIN_DIR}/ and "
            f"{TEST_DIR}/, each with one folder per class"
        )
    index = {name: i for i, name in enumerate(classes)}
    stray = sorted(d.name for d in split_dir.iterdir() if d.is_dir() and d.name not in index)
    if stray:
        raise ImageFolderError(
            f"{split_dir} has class folder(s) {', '.join(stray[:5])} that are not among the "
            f"node's classes ({', '.join(classes[:10])}{', ...' if len(classes) > 10 else ''})"
        )
    items: list[tuple[Path, int]] = []
    for name in classes:
        folder = split_dir / name
        if folder.is_dir():
            items.extend((p, index[name]) for p in sorted(folder.iterdir()) if is_image(p))
    return items


def scan_source(src: Path) -> tuple[list[Path], np.ndarray, list[str]]:
    """Every image of a source folder, its label, and the class names.

    The source is `SRC/<class>/*` or, like CIFAR-10 exported as PNGs, `SRC/train/<class>/*`
    (and `SRC/test/<class>/*`): then both are pooled, and each node's held-out split is cut
    from its own share, as `fedgpu data split` does for digits.
    """
    src = Path(src)
    if not src.is_dir():
        raise ImageFolderError(f"{src} is not a directory")
    roots = [src / s for s in SPLIT_DIRS if (src / s).is_dir()] or [src]
    classes = sorted({d.name for r in roots for d in r.iterdir() if d.is_dir()})
    if not classes:
        raise ImageFolderError(
            f"{src} has no class folders: expected {src}/<class>/*.png or "
            f"{src}/{TRAIN_DIR}/<class>/*.png"
        )
    if len(classes) > MAX_CLASSES:
        raise ImageFolderError(f"{src} has {len(classes)} folders, more than {MAX_CLASSES} "
                               f"classes: point at the folder whose subfolders are the classes")
    paths: list[Path] = []
    labels: list[int] = []
    for root in roots:
        for path, label in list_images(root, classes):
            paths.append(path)
            labels.append(label)
    if not paths:
        suffixes = ", ".join(sorted(IMAGE_SUFFIXES))
        raise ImageFolderError(f"{src} holds no images ({suffixes}) in its class folders")
    return paths, np.asarray(labels, dtype=np.int64), classes


def split_folder(
    src: Path,
    out: Path,
    nodes: int,
    partition: Partition = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    test_fraction: float = 0.2,
    force: bool = False,
) -> list[Path]:
    """Partition an image folder into `out/node-1 .. node-N`; return those directories.

    Files are hard-linked where `out` is on the same file system (no second copy of a large
    data set), copied otherwise.
    """
    out = Path(out)
    validate_split_args(out, nodes, partition, alpha, test_fraction, force)
    paths, labels, classes = scan_source(src)
    rng = np.random.default_rng(seed)
    try:
        parts = partition_indices(labels, nodes, partition, alpha, rng)
    except ValueError as exc:
        raise ImageFolderError(f"{src}: {exc}") from None
    if force and out.exists():
        remove_old_splits(out)
    out.mkdir(parents=True, exist_ok=True)
    dirs: list[Path] = []
    for number, idx in enumerate(parts, start=1):
        train_idx, test_idx = holdout_cut(idx, test_fraction, rng)
        node_dir = out / f"{NODE_DIR_PREFIX}{number}"
        make_class_dirs(node_dir, classes)
        for split, chosen in ((TRAIN_DIR, train_idx), (TEST_DIR, test_idx)):
            for i in chosen:
                # The index keeps names unique when train/ and test/ of the source share them.
                target = node_dir / split / classes[labels[i]] / f"{i:07d}-{paths[i].name}"
                _link_or_copy(paths[i], target)
        write_meta(node_dir, {
            "dataset": "image-folder", "source": str(Path(src).resolve()), "node": number,
            "nodes": nodes, "partition": partition,
            "alpha": alpha if partition == "dirichlet" else None, "seed": seed,
            "test_fraction": test_fraction,
        }, classes, labels[train_idx], labels[test_idx])
        dirs.append(node_dir)
    return dirs


def make_class_dirs(node_dir: Path, classes: list[str]) -> None:
    for split in SPLIT_DIRS:
        for name in classes:
            (node_dir / split / name).mkdir(parents=True, exist_ok=True)


def write_meta(node_dir: Path, meta: dict[str, object], classes: list[str],
               train_labels: np.ndarray, test_labels: np.ndarray) -> None:
    doc = {
        **meta,
        "classes": classes,
        "num_train": int(len(train_labels)),
        "num_test": int(len(test_labels)),
        "class_histogram": {
            TRAIN_DIR: [int(c) for c in np.bincount(train_labels, minlength=len(classes))],
            TEST_DIR: [int(c) for c in np.bincount(test_labels, minlength=len(classes))],
        },
    }
    (node_dir / META_FILE).write_text(json.dumps(doc, indent=2) + "\n")


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        # Another file system, or one without hard links: a copy it is.
        shutil.copyfile(src, dst)
