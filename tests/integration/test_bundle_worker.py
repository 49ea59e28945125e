"""A bundle loaded by the real round worker (`python -m fedgpu.node.rounds.worker WORKDIR`): the
checks it makes before importing anything, and where the import happens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fedgpu.core.bundles import Bundle, open_archive, pack_files
from fedgpu.core.datasets import split_digits

REPO = Path(__file__).resolve().parents[2]
TASK = """\
import os

import torch

from fedgpu.node.tasks.digits import DigitsTask

# Importing this module leaves a trace: which process imported it.
if os.environ.get("BUNDLE_MARKER"):
    with open(os.environ["BUNDLE_MARKER"], "a") as fh:
        fh.write(f"{os.getpid()}\\n")


class MarkedTask(DigitsTask):
    name = "marked"
"""


def bundle(task: str = TASK, requires: str = "[]", package: str = "marked_task",
           name: str = "marked") -> Bundle:
    return open_archive(pack_files({
        "fedgpu-task.toml": (f'name = "{name}"\nentry = "{package}.model:MarkedTask"\n'
                             f"requires = {requires}\n").encode(),
        f"{package}/__init__.py": b"",
        f"{package}/model.py": task.encode()}))


@pytest.fixture(scope="module")
def node_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return split_digits(tmp_path_factory.mktemp("split"), 2, seed=3)[0]


def run_worker(tmp: Path, b: Bundle, node_dir: Path, archive: bytes | None = None,
               **env: str) -> tuple[int, Path]:
    path = tmp / f"{b.sha256}.tar"
    path.write_bytes(b.data if archive is None else archive)
    workdir = tmp / "work"
    workdir.mkdir()
    task: dict[str, Any] = {
        "kind": "init", "task_name": b.manifest.name, "hyperparameters": {}, "seed": 1,
        "round": 0, "data_dir": str(node_dir), "device": "cpu", "memory_fraction": None,
        "torch_threads": 1,
        "bundle": {"path": str(path), "sha256": b.sha256, "name": b.manifest.name,
                   "entry": b.manifest.entry}}
    (workdir / "task.json").write_text(json.dumps(task))
    proc = subprocess.run([sys.executable, "-m", "fedgpu.node.rounds.worker", str(workdir)],
                          env={**os.environ, "PYTHONPATH": str(REPO), **env}, cwd=tmp,
                          capture_output=True, text=True, timeout=180)
    return proc.returncode, workdir


def error_of(workdir: Path) -> dict[str, Any]:
    return json.loads((workdir / "error.json").read_text())


def test_the_worker_imports_the_bundle_from_its_own_unpacked_copy(tmp_path: Path,
                                                                   node_dir: Path) -> None:
    marker = tmp_path / "marker"
    code, workdir = run_worker(tmp_path, bundle(), node_dir, BUNDLE_MARKER=str(marker))
    assert code == 0, error_of(workdir)
    assert (workdir / "weights.out.safetensors").stat().st_size > 0
    # Imported once, by the worker process (not this test's), from the round's directory.
    [pid] = marker.read_text().split()
    assert int(pid) != os.getpid()
    assert (workdir / "bundle" / "marked_task" / "model.py").read_text() == TASK
    assert not list((workdir / "bundle").rglob("__pycache__"))


def test_a_cached_copy_that_changed_after_the_check_is_refused(tmp_path: Path,
                                                               node_dir: Path) -> None:
    b = bundle()
    tampered = b.data.replace(b"BUNDLE_MARKER", b"BUNDLE_MARKEX")
    assert tampered != b.data and len(tampered) == len(b.data)
    marker = tmp_path / "marker"
    code, workdir = run_worker(tmp_path, b, node_dir, archive=tampered,
                               BUNDLE_MARKER=str(marker), BUNDLE_MARKEX=str(marker))
    assert code == 2
    err = error_of(workdir)
    assert err["kind"] == "bad_input"
    assert f"the cached copy {tmp_path / (b.sha256 + '.tar')} of bundle {b.sha256} is " \
           "refused: bundle content does not match its hash" in err["error"]
    assert not marker.exists() and not (workdir / "bundle").exists()


def test_an_unmet_requirement_is_refused_before_import(tmp_path: Path, node_dir: Path) -> None:
    marker = tmp_path / "marker"
    code, workdir = run_worker(tmp_path, bundle(requires='["numpy>=9999"]'), node_dir,
                               BUNDLE_MARKER=str(marker))
    assert code == 2
    assert "requires what this node lacks: numpy>=9999: numpy" in error_of(workdir)["error"]
    assert not marker.exists()


def test_a_bundle_shadowing_an_installed_module_is_refused(tmp_path: Path,
                                                           node_dir: Path) -> None:
    code, workdir = run_worker(tmp_path, bundle(package="json"), node_dir)
    assert code == 2
    assert "top-level module 'json' would shadow" in error_of(workdir)["error"]


def test_a_bundle_whose_code_fails_to_import_says_so(tmp_path: Path, node_dir: Path) -> None:
    code, workdir = run_worker(tmp_path, bundle(task="import surely_missing_module\n"
                                                     "MarkedTask = 1\n"), node_dir)
    assert code == 1
    err = error_of(workdir)["error"]
    assert "task 'marked'" in err and "failed to load" in err and "surely_missing_module" in err
