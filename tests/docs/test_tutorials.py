"""The tutorials run as written: every command block of docs/tutorials/ is marked, and the
marked ones run in a fresh copy of the checkout with the project's venv on PATH
(tests/fixtures/doc_blocks.py says how). The compose tutorial needs a Docker engine and runs in
the e2e suite (tests/e2e/test_docs_compose.py)."""

from __future__ import annotations

import json
import re
import shutil
import socket
from pathlib import Path

import pytest

from tests.fixtures.doc_blocks import ROOT, Block, DocBlockError, PageRun, blocks, run_page

TUTORIALS = ROOT / "docs" / "tutorials"


def test_every_command_block_of_the_tutorials_is_marked() -> None:
    pages = sorted(TUTORIALS.glob("*.md"))
    found: dict[str, list[Block]] = {}
    for page in pages:
        found[page.name] = blocks(page)  # raises on an unmarked block or a skip without reason
    for name in ("first-federation.md", "compose.md", "own-task.md", "kubernetes.md"):
        assert [b for b in found[name] if b.run], f"{name} runs no block"
    # Each tutorial page is run by some test: here, or in the e2e suite; the language-model
    # tutorial by tests/integration/test_causal_lm.py (which checks its outcome too), the
    # three-hosts one by tests/docs/test_three_hosts.py (it needs network namespaces), the
    # three-hospitals one by tests/docs/test_three_hospitals.py (it checks what the run left).
    covered = {"first-federation.md", "own-task.md", "kubernetes.md", "compose.md",
               "fine-tune-a-language-model.md", "three-hosts.md",
               "three-hospitals-two-studies.md"}
    assert {n for n, bs in found.items() if bs} <= covered, "a new tutorial needs its test"


def test_an_unmarked_block_or_a_skip_without_reason_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("Intro\n\n```bash\nfedgpu run\n```\n")
    with pytest.raises(DocBlockError, match="without a marker"):
        blocks(page)
    page.write_text("<!-- docs-test: skip -->\n```bash\nfedgpu run\n```\n")
    with pytest.raises(DocBlockError, match="must say why"):
        blocks(page)
    page.write_text("<!-- docs-test: run -->\n```\nfedgpu run\n```\n")
    with pytest.raises(DocBlockError, match="without a language"):
        blocks(page)
    page.write_text('<!-- docs-test: run expect="x" tmeout=5 -->\n```bash\ntrue\n```\n'
                    "```text\nnot a command\n```\n")
    with pytest.raises(DocBlockError, match="unknown marker"):
        blocks(page)


def test_the_runner_fails_a_block_as_a_reader_would_see_it_fail(tmp_path: Path) -> None:
    """Exports and `cd` carry between blocks, a failing command inside a block fails it, a
    missing expected line fails it, and a background process is stopped at the end."""
    page = tmp_path / "page.md"
    page.write_text(
        '<!-- docs-test: run -->\n```bash\nexport GREETING=hello\nmkdir sub && cd sub\n'
        "sleep 300 &\necho $! > ../sleeper.pid\n```\n"
        '<!-- docs-test: run expect="hello from sub" -->\n```bash\necho "$GREETING from '
        '$(basename "$PWD")"\n```\n'
        '<!-- docs-test: run -->\n```bash\nfalse\necho "not reached"\n```\n'
        '<!-- docs-test: run expect="absent" -->\n```bash\necho present\n```\n')
    first, second, failing, wrong = blocks(page)
    work = tmp_path / "work"
    work.mkdir()
    with PageRun(work, tmp_path / "runner", {"PATH": "/usr/bin:/bin"}) as runner:
        runner.check(first)
        assert "hello from sub" in runner.check(second).output
        r = runner.run(failing)
        assert r.returncode != 0 and "not reached" not in r.output
        with pytest.raises(AssertionError, match="expected 'absent'"):
            runner.check(wrong)
        pid = int((work / "sleeper.pid").read_text())
        assert Path(f"/proc/{pid}").exists()
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(
        f"/proc/{pid}/status").read_text().lower()


def _after_make_demo(work: Path) -> None:
    """A reader who ran `make demo` first has a run directory already."""
    earlier = work / "runs" / "20000101-000000"
    earlier.mkdir(parents=True)
    (earlier / "rounds.json").write_text("{}")


def test_first_federation_runs_as_written(tmp_path: Path) -> None:
    results = run_page(TUTORIALS / "first-federation.md", tmp_path, setup=_after_make_demo)
    # The whole tutorial stays a quick test (the issue asks < 1 min; the run itself is ~20 s).
    assert sum(r.seconds for r in results) < 120, [(r.block.where(), r.seconds) for r in results]
    runs = tmp_path / "checkout" / "runs"
    (run_dir,) = {p for p in runs.iterdir() if p.name not in ("20000101-000000", "latest")}
    assert (runs / "latest").resolve() == run_dir.resolve()
    check_json_reference(run_dir)


@pytest.mark.slow  # a real aggregator, two nodes and a bundle check: ~45 s on 2 idle cores
def test_own_task_runs_as_written(tmp_path: Path) -> None:
    # The tutorial starts an aggregator on the default port, as a reader would.
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 50051)) == 0:
            pytest.skip("127.0.0.1:50051 is taken: the own-task tutorial uses the default port")
    run_page(TUTORIALS / "own-task.md", tmp_path)


def test_kubernetes_commands_that_need_no_cluster_run_as_written(tmp_path: Path) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("no kubectl on PATH (tools/install_kubectl.sh installs it)")
    results = run_page(TUTORIALS / "kubernetes.md", tmp_path)
    secrets = tmp_path / "checkout" / "secrets"
    assert sorted(p.name for p in secrets.iterdir()) == [
        "tls-aggregator.json", "tls-node-cpu-1.json", "tls-node-cpu-2.json",
        "tls-node-cpu-3.json"], results[-1].output


def _section(page: str, heading: str) -> str:
    text = (ROOT / "docs" / page).read_text()
    return text.split(f"\n## {heading}\n")[1].split("\n## ")[0]


def _keys(doc: object) -> set[str]:
    return {k for k in doc if k != "..."} if isinstance(doc, dict) else set()


def check_json_reference(run_dir: Path) -> None:
    """The `status --json` and `rounds --json` documents a real run wrote have exactly the keys
    docs/reference/json.md shows: a key added to the code and not to the page (or the other
    way round) fails here. Keys a record has only sometimes must be named in the page's prose."""
    real_status = json.loads((run_dir / "status.json").read_text())
    real_rounds = json.loads((run_dir / "rounds.json").read_text())
    for heading, real, parts in (
        ("`fedgpu status --json`", real_status, [(lambda d: d, lambda d: d)]),
        ("`fedgpu rounds --json`", real_rounds, [
            (lambda d: d, lambda d: d),
            (lambda d: d["rounds"][0], lambda d: d["rounds"][0]),
            (lambda d: d["rounds"][0]["updates"][0], lambda d: d["rounds"][0]["updates"][0]),
            (lambda d: d["rounds"][0]["updates"][0]["resources"],
             lambda d: d["rounds"][0]["updates"][0]["resources"]),
        ]),
    ):
        section = _section("reference/json.md", heading)
        example = json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))
        prose = set(re.findall(r"`([a-z_]+)`", section))
        for pick_doc, pick_real in parts:
            documented, actual = _keys(pick_doc(example)), _keys(pick_real(real))
            assert actual <= documented | prose, (heading, sorted(actual - documented - prose))
            assert documented <= actual | prose, (heading, sorted(documented - actual - prose))
