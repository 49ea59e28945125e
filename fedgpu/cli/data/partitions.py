"""`fedgpu data split|synth-images|split-folder`: per-node data directories, made locally."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from fedgpu.core.constants import Partition
from fedgpu.core.datasets import MissingDependencyError, read_meta, split_digits


def split(
    out: Annotated[
        Path, typer.Option("--out", help="Directory to write node-1 .. node-N into.")
    ],
    nodes: Annotated[int, typer.Option("--nodes", help="Number of node partitions.")],
    partition: Annotated[
        Partition,
        typer.Option(
            "--partition",
            help="iid: seeded shuffle; dirichlet: label skew drawn per class with --alpha.",
        ),
    ] = Partition.IID,
    alpha: Annotated[
        float,
        typer.Option(
            "--alpha", help="Dirichlet concentration: small = strong skew, large = near IID."
        ),
    ] = 0.5,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the split.")] = 0,
    test_fraction: Annotated[
        float, typer.Option("--test-fraction", help="Share of each node's data held out.")
    ] = 0.2,
    force: Annotated[
        bool, typer.Option("--force", help="Replace the node-K directories of an earlier split.")
    ] = False,
) -> None:
    """Split the digits dataset (bundled with scikit-learn) into per-node data directories.

    Example: fedgpu data split --out data --nodes 3 --partition dirichlet --alpha 0.3
    """
    try:
        dirs = split_digits(
            out,
            nodes,
            partition=partition.value,
            alpha=alpha,
            seed=seed,
            test_fraction=test_fraction,
            force=force,
        )
    except (ValueError, MissingDependencyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    skew = f", alpha {alpha}" if partition is Partition.DIRICHLET else ""
    print(f"digits split: {nodes} node(s), {partition.value}{skew}, seed {seed}", file=sys.stderr)
    for d in dirs:
        meta = read_meta(d)
        hist = " ".join(f"{c}:{n}" for c, n in enumerate(meta["class_histogram"]["train"]))
        print(
            f"  {d.name}: {meta['num_train']} train / {meta['num_test']} test  classes {hist}",
            file=sys.stderr,
        )
    # The directories alone on stdout, one per line, so scripts can read them.
    for d in dirs:
        print(d)


def synth_images_cmd(
    out: Annotated[
        Path, typer.Option("--out", help="Directory to write node-1 .. node-N into.")
    ],
    nodes: Annotated[int, typer.Option("--nodes", help="Number of node directories.")],
    classes: Annotated[int, typer.Option("--classes", help="Number of classes.")] = 10,
    per_class: Annotated[int, typer.Option(
        "--per-class", help="Images of each class on each node (train + held out).")] = 100,
    size: Annotated[int, typer.Option("--size", help="Image side in pixels.")] = 32,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the patterns and the noise.")] = 0,
    test_fraction: Annotated[float, typer.Option(
        "--test-fraction", help="Share of each class held out in test/.")] = 0.2,
    force: Annotated[
        bool, typer.Option("--force", help="Replace the node-K directories of an earlier split.")
    ] = False,
) -> None:
    """Write a synthetic, learnable image data set (PNG, a folder per class) for task images.

    Example: fedgpu data synth-images --out images --nodes 3
    """
    from fedgpu.core.synth_images import synth_images

    try:
        dirs = synth_images(out, nodes, classes=classes, per_class=per_class, size=size,
                            seed=seed, test_fraction=test_fraction, force=force)
    except (ValueError, MissingDependencyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    print(f"synthetic images: {nodes} node(s), {classes} classes, {per_class} per class and "
          f"node, {size}x{size}, seed {seed}", file=sys.stderr)
    _print_dirs(dirs)


def split_folder_cmd(
    src: Annotated[Path, typer.Argument(
        help="Image folder: SRC/<class>/*.png, or SRC/train/<class>/ (+ SRC/test/<class>/).")],
    out: Annotated[
        Path, typer.Option("--out", help="Directory to write node-1 .. node-N into.")
    ],
    nodes: Annotated[int, typer.Option("--nodes", help="Number of node partitions.")],
    partition: Annotated[Partition, typer.Option(
        "--partition",
        help="iid: seeded shuffle; dirichlet: label skew drawn per class with --alpha.")
    ] = Partition.IID,
    alpha: Annotated[float, typer.Option(
        "--alpha", help="Dirichlet concentration: small = strong skew, large = near IID.")
    ] = 0.5,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the split.")] = 0,
    test_fraction: Annotated[float, typer.Option(
        "--test-fraction", help="Share of each node's images held out in test/.")] = 0.2,
    force: Annotated[
        bool, typer.Option("--force", help="Replace the node-K directories of an earlier split.")
    ] = False,
) -> None:
    """Partition an image folder (e.g. CIFAR-10 exported as PNGs) into per-node directories.

    Files are hard-linked into OUT where it is on the same file system, copied otherwise.

    Example: fedgpu data split-folder photos --out data --nodes 3
    """
    from fedgpu.core.imagefolders import split_folder

    try:
        dirs = split_folder(src, out, nodes, partition=partition.value, alpha=alpha, seed=seed,
                            test_fraction=test_fraction, force=force)
    except ValueError as exc:  # ImageFolderError is one
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    skew = f", alpha {alpha}" if partition is Partition.DIRICHLET else ""
    print(f"{src} split: {nodes} node(s), {partition.value}{skew}, seed {seed}", file=sys.stderr)
    _print_dirs(dirs)


def _print_dirs(dirs: list[Path]) -> None:
    for d in dirs:
        meta = read_meta(d)
        hist = " ".join(str(n) for n in meta["class_histogram"]["train"])
        print(f"  {d.name}: {meta['num_train']} train / {meta['num_test']} test  "
              f"per class {hist}", file=sys.stderr)
    # The directories alone on stdout, one per line, so scripts can read them.
    for d in dirs:
        print(d)
