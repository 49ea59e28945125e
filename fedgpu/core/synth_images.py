"""`fedgpu data synth-images`: a synthetic, learnable image data set in the per-node layout.

Each class is a stripe pattern (a direction and a frequency) over a class colour; each image
draws its own phase, contrast and colour jitter and adds pixel noise. The pattern survives the
`images` task's augmentation (a shift moves the phase, a horizontal flip keeps the direction
and frequency), so a small ResNet learns it in a few rounds, while the noise and the jitter
keep it from being solved by one pixel. Tests and demos need no download.

Pillow is imported when images are written: the aggregator image does not install it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedgpu.core.datasets import (
    NODE_DIR_PREFIX,
    MissingDependencyError,
    remove_old_splits,
    validate_split_args,
)
from fedgpu.core.imagefolders import TEST_DIR, TRAIN_DIR, make_class_dirs, write_meta

MAX_CLASSES = 1000
MAX_PER_CLASS = 100_000
MIN_SIZE, MAX_SIZE = 8, 512
# Stripe frequencies (cycles per image) and directions: 2 x 6 = 12 distinct patterns; beyond
# 12 classes the class colour alone tells them apart.
_FREQUENCIES = (1, 2, 3, 4, 5, 6)
_NOISE = 0.12


def class_names(classes: int) -> list[str]:
    width = len(str(classes - 1))
    return [f"class-{c:0{width}d}" for c in range(classes)]


def class_colours(classes: int, seed: int) -> np.ndarray:
    """Each class's base colour, RGB in [0.2, 0.8]; the same on every node for a seed."""
    return np.random.default_rng(seed).uniform(0.2, 0.8, (classes, 3))


def render(label: int, colours: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """One image of class `label` as uint8 [size, size, 3]."""
    freq = _FREQUENCIES[(label // 2) % len(_FREQUENCIES)]
    coord = np.arange(size, dtype=np.float32) / size
    phase = rng.uniform(0, 2 * np.pi)
    wave = np.sin(2 * np.pi * freq * coord + phase)
    # Even labels: vertical stripes (vary along x); odd: horizontal (vary along y).
    stripes = np.tile(wave, (size, 1)) if label % 2 == 0 else np.tile(wave[:, None], (1, size))
    contrast = rng.uniform(0.15, 0.3)
    colour = colours[label] + rng.normal(0, 0.05, 3)
    img = colour[None, None, :] + contrast * stripes[:, :, None]
    img = img + rng.normal(0, _NOISE, img.shape)
    return (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)


def synth_images(
    out: Path,
    nodes: int,
    classes: int = 10,
    per_class: int = 100,
    size: int = 32,
    seed: int = 0,
    test_fraction: float = 0.2,
    force: bool = False,
) -> list[Path]:
    """Write `out/node-1 .. node-N`, each with `per_class` images of every class.

    Of each class's images on a node, `test_fraction` (at least one) go to test/. The class
    patterns depend on `seed` alone, so every node draws from the same distribution; the
    images themselves differ per node.
    """
    out = Path(out)
    validate_split_args(out, nodes, "iid", 1.0, test_fraction, force)
    if not 2 <= classes <= MAX_CLASSES:
        raise ValueError(f"--classes must be between 2 and {MAX_CLASSES}, got {classes}")
    if not 2 <= per_class <= MAX_PER_CLASS:
        raise ValueError(f"--per-class must be between 2 and {MAX_PER_CLASS}, got {per_class}")
    if not MIN_SIZE <= size <= MAX_SIZE:
        raise ValueError(f"--size must be between {MIN_SIZE} and {MAX_SIZE}, got {size}")
    try:
        from PIL import Image
    except ImportError as exc:
        raise MissingDependencyError(
            "writing images needs Pillow, which the node extra installs: pip install "
            "'fedgpu[node]'"
        ) from exc
    n_test = min(max(1, round(per_class * test_fraction)), per_class - 1)
    names = class_names(classes)
    colours = class_colours(classes, seed)
    if force and out.exists():
        remove_old_splits(out)
    dirs: list[Path] = []
    for number in range(1, nodes + 1):
        rng = np.random.default_rng([seed, number])
        node_dir = out / f"{NODE_DIR_PREFIX}{number}"
        make_class_dirs(node_dir, names)
        for label, name in enumerate(names):
            for i in range(per_class):
                split = TEST_DIR if i < n_test else TRAIN_DIR
                pixels = render(label, colours, size, rng)
                # compress_level 1: these files are written once per test run, read often.
                Image.fromarray(pixels).save(
                    node_dir / split / name / f"{i:06d}.png", compress_level=1)
        counts = np.repeat(np.arange(classes), per_class - n_test)
        write_meta(node_dir, {
            "dataset": "synthetic-images", "node": number, "nodes": nodes, "seed": seed,
            "size": size, "per_class": per_class, "test_fraction": test_fraction,
        }, names, counts, np.repeat(np.arange(classes), n_test))
        dirs.append(node_dir)
    return dirs
