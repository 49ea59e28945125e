"""`fedgpu data split`: per-node partitions of the packaged digits dataset."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from fedgpu.core.constants import Partition
from fedgpu.core.datasets import MissingDependencyError, read_meta, split_digits


def register(app: typer.Typer) -> None:
    data_app = typer.Typer(
        help="Datasets for demos and tests: per-node partitions, made locally.",
        no_args_is_help=True,
    )
    data_app.command("split")(split)
    app.add_typer(data_app, name="data")


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
    """Split the digits dataset (bundled with scikit-learn) into per-node data directories."""
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
