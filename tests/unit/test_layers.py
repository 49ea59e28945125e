"""The layers (core < node | server < cli, and the aggregator's parts in their order) hold,
no two files import each other in a loop, and a broken one fails the check.

import-linter runs on the installed layout that tools/lint_layers.py stages, the cycle finder
(tools/import_cycles.py) on the same; both run in `make lint`. The import-time checks run
fresh interpreters: what `import fedgpu.core` and the aggregator's `fedgpu server start
--help` really load.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.federation import ROOT, base_env

LINT = [sys.executable, str(ROOT / "tools" / "lint_layers.py")]
CYCLES = [sys.executable, str(ROOT / "tools" / "import_cycles.py")]
HEAVY = ("torch", "pynvml", "fedgpu.node", "fedgpu.server")


def _copy_tree(dest: Path) -> Path:
    for part in ("fedgpu", "node", "server"):
        shutil.copytree(ROOT / part, dest / part,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _lint(root: Path, tool: list[str] = LINT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*tool, "--root", str(root)], capture_output=True, text=True,
                          env=base_env(), timeout=300)


def test_the_repository_keeps_every_contract() -> None:
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("KEPT") == 9 and "BROKEN" not in r.stdout


@pytest.mark.parametrize(("module", "bad_import", "contract"), [
    ("fedgpu/core/codec.py", "from fedgpu.node import nvml",
     "cli above node and server, both above core"),
    ("server/registry.py", "from fedgpu.node import policy",
     "node and server never import each other"),
    ("server/strategies/aggregate.py", "import torch", "no torch, no NVML"),
    ("server/rounds/engine.py", "from fedgpu.server.views import metrics",
     "views are read by nothing below them"),
    ("server/strategies/fedavg.py", "from fedgpu.server.rounds import records",
     "strategies know arrays"),
    ("node/rounds/runner.py", "from fedgpu.node import agent", "never reaches back"),
    ("server/secagg/driver.py", "from fedgpu.server.jobs import queue",
     "parts import downwards only"),
    ("server/transfer/uploads.py", "from fedgpu.server.rounds import states",
     "transfer moves bytes"),
    ("server/transfer/bulk_server.py", "from fedgpu.server import federation_service",
     "transfer moves bytes"),
    ("server/rounds/receive.py", "from fedgpu.server.secagg import intake",
     "round engine knows no secure aggregation"),
])
def test_one_bad_import_breaks_its_contract(tmp_path: Path, module: str, bad_import: str,
                                            contract: str) -> None:
    root = _copy_tree(tmp_path)
    path = root / module
    path.write_text(path.read_text() + f"\n{bad_import}  # added by the test\n")
    r = _lint(root)
    assert r.returncode != 0, r.stdout
    broken = re.findall(r"^(.*) BROKEN$", r.stdout, re.M)
    assert any(contract in name for name in broken), r.stdout


def test_no_two_modules_import_each_other() -> None:
    r = _lint(ROOT, CYCLES)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CYCLE" not in r.stdout and " 0 import cycle(s) not known" in r.stdout


def test_a_cycle_only_type_checkers_follow_is_found(tmp_path: Path) -> None:
    # records.py is imported by attempt.py; this closes the loop under TYPE_CHECKING, which
    # no run would trip over: the finder must see it all the same.
    root = _copy_tree(tmp_path)
    path = root / "server/rounds/records.py"
    path.write_text(path.read_text() + "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:"
                    "\n    from fedgpu.server.rounds.attempt import RoundState  # by the test\n")
    r = _lint(root, CYCLES)
    assert r.returncode == 1, r.stdout
    assert ("CYCLE among: fedgpu.server.rounds.attempt, fedgpu.server.rounds.records"
            in r.stdout), r.stdout


def _loaded(code: list[str]) -> set[str]:
    r = subprocess.run([sys.executable, "-X", "importtime", *code], capture_output=True,
                       text=True, env=base_env(), cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    names = set(re.findall(r"import time:.*\|\s*(\S+)\s*$", r.stderr, re.M))
    assert "fedgpu" in names  # the profile really was taken
    return names


def _heavy(names: set[str]) -> list[str]:
    return sorted(n for n in names if any(n == h or n.startswith(h + ".") for h in HEAVY))


def test_importing_core_loads_neither_node_server_torch_nor_nvml() -> None:
    names = _loaded(["-c", "import fedgpu.core, fedgpu.core.codec, fedgpu.core.job, "
                     "fedgpu.core.transport, fedgpu.core.tls, fedgpu.core.datasets"])
    assert _heavy(names) == []


def test_the_aggregator_command_line_loads_no_node_code() -> None:
    names = _loaded(["-m", "fedgpu.cli.app", "server", "start", "--help"])
    assert _heavy(names) == []
    assert "fedgpu.cli.server.start" in names
