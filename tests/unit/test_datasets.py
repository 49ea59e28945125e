"""Per-node partitions of the digits dataset: fedgpu.core.datasets and `fedgpu data split`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from fedgpu.cli.app import app
from fedgpu.core import codec
from fedgpu.core.datasets import (
    MIN_EXAMPLES_PER_NODE,
    MissingDependencyError,
    load_digits_arrays,
    partition_indices,
    split_digits,
)

N_DIGITS = 1797


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    return load_digits_arrays()[1]


def _label_skew(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    """Mean total-variation distance between each node's class mix and the global one."""
    overall = np.bincount(labels, minlength=10) / len(labels)
    dists = [
        0.5 * np.abs(np.bincount(labels[p], minlength=10) / len(p) - overall).sum() for p in parts
    ]
    return float(np.mean(dists))


@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
@pytest.mark.parametrize("nodes", [1, 3, 7])
def test_partitions_are_disjoint_and_cover_everything(
    labels: np.ndarray, partition: str, nodes: int
) -> None:
    parts = partition_indices(labels, nodes, partition, 0.3, np.random.default_rng(1))  # type: ignore[arg-type]
    assert len(parts) == nodes
    joined = np.concatenate(parts)
    assert len(joined) == len(labels)
    np.testing.assert_array_equal(np.sort(joined), np.arange(len(labels)))
    assert min(len(p) for p in parts) >= MIN_EXAMPLES_PER_NODE


def test_dirichlet_skew_is_visible_and_iid_is_balanced(labels: np.ndarray) -> None:
    iid = partition_indices(labels, 5, "iid", 1.0, np.random.default_rng(0))
    sizes = [len(p) for p in iid]
    assert max(sizes) - min(sizes) <= 1
    skewed = partition_indices(labels, 5, "dirichlet", 0.1, np.random.default_rng(0))
    mild = partition_indices(labels, 5, "dirichlet", 100.0, np.random.default_rng(0))
    assert _label_skew(labels, iid) < 0.1
    assert _label_skew(labels, skewed) > 0.4
    assert _label_skew(labels, mild) < _label_skew(labels, skewed)


def test_tiny_alpha_with_many_nodes_still_feeds_every_node(labels: np.ndarray) -> None:
    parts = partition_indices(labels, 40, "dirichlet", 0.01, np.random.default_rng(3))
    assert min(len(p) for p in parts) >= MIN_EXAMPLES_PER_NODE
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))


def test_split_writes_node_dirs_readable_with_the_codec(tmp_path: Path) -> None:
    dirs = split_digits(tmp_path / "data", 3, "dirichlet", alpha=0.5, seed=7)
    assert [d.name for d in dirs] == ["node-1", "node-2", "node-3"]
    total = 0
    for d in dirs:
        meta = json.loads((d / "meta.json").read_text())
        assert meta["partition"] == "dirichlet" and meta["alpha"] == 0.5 and meta["seed"] == 7
        for split in ("train", "test"):
            tensors, metadata = codec.decode((d / f"{split}.safetensors").read_bytes())
            x, y = tensors["x"], tensors["y"]
            assert set(tensors) == {"x", "y"}
            assert x.dtype == np.float32 and x.shape[1:] == (1, 8, 8)
            assert y.dtype == np.int64 and y.shape == (x.shape[0],)
            assert 0.0 <= x.min() and x.max() <= 1.0
            assert meta[f"num_{split}"] == len(y) > 0
            assert meta["class_histogram"][split] == np.bincount(y, minlength=10).tolist()
            assert metadata["split"] == split
            total += len(y)
        size = meta["num_train"] + meta["num_test"]
        assert meta["num_test"] == pytest.approx(0.2 * size, abs=1)
    assert total == N_DIGITS


def test_split_is_reproducible_from_its_seed(tmp_path: Path) -> None:
    def files(seed: int, name: str) -> list[bytes]:
        dirs = split_digits(tmp_path / name, 2, "dirichlet", alpha=0.5, seed=seed)
        names = ("train.safetensors", "test.safetensors")
        return [(d / f).read_bytes() for d in dirs for f in names]

    assert files(5, "a") == files(5, "b")
    assert files(5, "a2") != files(6, "c")


def test_iid_meta_has_no_alpha(tmp_path: Path) -> None:
    (d,) = split_digits(tmp_path / "x", 1, "iid", alpha=3.0, seed=0)
    assert json.loads((d / "meta.json").read_text())["alpha"] is None


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"nodes": 0}, "--nodes must be at least 1"),
        ({"nodes": 2, "alpha": 0.0}, "--alpha must be > 0"),
        ({"nodes": 2, "alpha": -1.0}, "--alpha must be > 0"),
        ({"nodes": 2, "partition": "shards"}, "unknown partition 'shards'"),
        ({"nodes": 2, "test_fraction": 1.0}, "test_fraction"),
        ({"nodes": 1000}, "at most 179 nodes"),
    ],
)
def test_bad_arguments_are_one_line_value_errors(
    tmp_path: Path, kwargs: dict[str, object], needle: str
) -> None:
    with pytest.raises(ValueError) as info:
        split_digits(tmp_path / "out", **kwargs)  # type: ignore[arg-type]
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_non_empty_out_needs_force_and_force_drops_stale_nodes(tmp_path: Path) -> None:
    out = tmp_path / "data"
    split_digits(out, 4)
    (out / "README.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty; pass --force"):
        split_digits(out, 2)
    split_digits(out, 2, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["README.txt", "node-1", "node-2"]


def test_missing_scikit_learn_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A None entry in sys.modules makes the import raise ImportError, as if not installed.
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(MissingDependencyError, match=r"fedgpu\[node\]"):
        split_digits(tmp_path / "x", 2)


def _app() -> typer.Typer:
    return app


def test_cli_split_prints_dirs_on_stdout_and_summary_on_stderr(tmp_path: Path) -> None:
    out = tmp_path / "d"
    args = ["data", "split", "--out", str(out), "--nodes", "3", "--partition", "dirichlet"]
    result = CliRunner().invoke(_app(), [*args, "--alpha", "0.3", "--seed", "4"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.split() == [str(out / f"node-{i}") for i in (1, 2, 3)]
    assert "dirichlet, alpha 0.3, seed 4" in result.stderr
    assert "node-2:" in result.stderr and "train /" in result.stderr


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--nodes", "0"], "error: --nodes must be at least 1"),
        (["--nodes", "2", "--partition", "dirichlet", "--alpha", "0"], "error: --alpha must be"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(tmp_path: Path, extra: list[str], needle: str) -> None:
    result = CliRunner().invoke(_app(), ["data", "split", "--out", str(tmp_path / "o"), *extra])
    assert result.exit_code == 2
    assert result.stderr.startswith(needle)
    assert result.stderr.count("\n") == 1
    assert result.stdout == ""


def test_cli_refuses_non_empty_out_without_force(tmp_path: Path) -> None:
    (tmp_path / "keep").write_text("x")
    args = ["data", "split", "--out", str(tmp_path), "--nodes", "2"]
    result = CliRunner().invoke(_app(), args)
    assert result.exit_code == 2
    assert "pass --force" in result.stderr
    assert CliRunner().invoke(_app(), [*args, "--force"]).exit_code == 0
