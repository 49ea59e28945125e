"""The audit log's chain (fedgpu.core.audit) against a real file that is tampered with.

Threat model (see the module): someone who can write the log after the fact. Each test
changes a real log the way such a person (or a crash) would and checks `verify` names the
first bad line; a cut at a record boundary is only visible against an exported head.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from fedgpu.core import audit


def _log(tmp_path: Path, n: int = 5, **kw: int) -> audit.AuditLog:
    log = audit.AuditLog(tmp_path / audit.AUDIT_FILE, **kw)
    for i in range(n):
        log.record(f"user{i}", "Admin.GetJob", f"job-{i}", "ok")
    return log


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def test_a_fresh_log_verifies_and_links_each_record(tmp_path: Path) -> None:
    log = _log(tmp_path)
    verdict = audit.verify(log.path)
    assert verdict.ok and verdict.records == 5
    records = list(audit.read(log.path))
    assert records[0]["prev"] == audit.GENESIS
    assert all(b["prev"] == a["hash"] for a, b in zip(records, records[1:], strict=False))
    assert verdict.head == records[-1]["hash"]
    assert records[2]["actor"] == "user2" and records[2]["target"] == "job-2"
    assert (log.path.stat().st_mode & 0o777) == 0o600


def test_an_edited_record_is_named(tmp_path: Path) -> None:
    log = _log(tmp_path)
    lines = _lines(log.path)
    lines[2] = lines[2].replace(b'"user2"', b'"alice"')
    log.path.write_bytes(b"".join(lines))
    verdict = audit.verify(log.path)
    assert not verdict.ok and verdict.problem is not None
    assert verdict.problem.line == 3 and "edited" in verdict.problem.reason


def test_an_edit_that_recomputes_its_hash_breaks_the_next_link(tmp_path: Path) -> None:
    log = _log(tmp_path)
    lines = _lines(log.path)
    record = json.loads(lines[1])
    record["outcome"] = "PERMISSION_DENIED"
    record["hash"] = audit.digest(record)
    lines[1] = audit.canonical(record) + b"\n"
    log.path.write_bytes(b"".join(lines))
    problem = audit.verify(log.path).problem
    assert problem is not None and problem.line == 3 and "out of chain" in problem.reason


def test_a_deleted_record_is_named(tmp_path: Path) -> None:
    log = _log(tmp_path)
    lines = _lines(log.path)
    del lines[1]
    log.path.write_bytes(b"".join(lines))
    problem = audit.verify(log.path).problem
    assert problem is not None and problem.line == 2 and "deleted" in problem.reason


def test_two_swapped_records_are_named(tmp_path: Path) -> None:
    log = _log(tmp_path)
    lines = _lines(log.path)
    lines[3], lines[4] = lines[4], lines[3]
    log.path.write_bytes(b"".join(lines))
    problem = audit.verify(log.path).problem
    assert problem is not None and problem.line == 4


def test_a_truncated_log_is_caught_torn_or_against_the_head(tmp_path: Path) -> None:
    log = _log(tmp_path)
    head = audit.verify(log.path).head
    data = log.path.read_bytes()
    # Mid-line: a torn last line.
    log.path.write_bytes(data[:-10])
    problem = audit.verify(log.path).problem
    assert problem is not None and problem.torn and problem.line == 5
    # At a record boundary: the chain alone is valid, the exported head is missing.
    log.path.write_bytes(b"".join(_lines(log.path)[:3]))
    assert audit.verify(log.path).ok
    problem = audit.verify(log.path, head=head).problem
    assert problem is not None and "head" in problem.reason


def test_a_writer_drops_a_torn_tail_and_says_so(tmp_path: Path) -> None:
    log = _log(tmp_path)
    log.path.write_bytes(log.path.read_bytes()[:-7])
    log.record("bob", "Admin.ListJobs")
    records = list(audit.read(log.path))
    assert records[-2]["action"] == "audit.torn-tail-dropped"
    assert records[-1]["actor"] == "bob"
    assert audit.verify(log.path).ok


def test_rotation_keeps_the_chain(tmp_path: Path) -> None:
    log = _log(tmp_path, n=40, max_bytes=2000)
    files = audit.files_of(log.path)
    assert len(files) >= 3, files
    first_of_new = json.loads(_lines(files[1])[0])
    last_of_old = json.loads(_lines(files[0])[-1])
    assert first_of_new["prev"] == last_of_old["hash"]
    verdict = audit.verify(log.path)
    assert verdict.ok and verdict.records == 40
    # Deleting a whole rotated file is a gap in the chain.
    files[1].unlink()
    problem = audit.verify(log.path).problem
    assert problem is not None and problem.file == str(files[2]) and problem.line == 1


def test_concurrent_writers_keep_one_chain(tmp_path: Path) -> None:
    log = audit.AuditLog(tmp_path / audit.AUDIT_FILE)
    other = audit.AuditLog(tmp_path / audit.AUDIT_FILE)  # a second writer, as another process

    def write(writer: audit.AuditLog, who: str) -> None:
        for i in range(25):
            writer.record(who, "x", str(i))

    threads = [threading.Thread(target=write, args=(w, f"t{i}"))
               for i, w in enumerate([log, log, other, other])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    verdict = audit.verify(log.path)
    assert verdict.ok and verdict.records == 100


def test_fields_are_bounded(tmp_path: Path) -> None:
    log = audit.AuditLog(tmp_path / audit.AUDIT_FILE)
    record = log.record("a" * 10_000, "x", "t" * 10_000, detail="d" * 100_000)
    assert len(audit.canonical(record)) < 4000
    assert audit.verify(log.path).ok


@pytest.mark.parametrize("garbage", [b"not json\n", b"[1, 2]\n", b'{"seq": 0}\n'])
def test_lines_that_are_no_records_are_named(tmp_path: Path, garbage: bytes) -> None:
    log = _log(tmp_path, n=2)
    with open(log.path, "ab") as fh:
        fh.write(garbage)
    problem = audit.verify(log.path).problem
    assert problem is not None and problem.line == 3


def test_a_sites_decisions_are_on_its_audit_log(tmp_path: Path) -> None:
    from fedgpu.node.approvals import SiteTasks

    site = SiteTasks(tmp_path)
    sha = "ab" * 32
    site.approve(sha, "hash")
    site.reject(sha, "directory /x")
    records = list(audit.read(tmp_path / audit.AUDIT_FILE))
    assert [(r["action"], r["target"]) for r in records] == \
        [("bundle.approve", sha), ("bundle.reject", sha)]
    assert records[1]["detail"] == "from directory /x" and records[0]["actor"]
    assert audit.verify(tmp_path / audit.AUDIT_FILE).ok


def test_the_cli_names_the_first_bad_line_and_exits_1(tmp_path: Path) -> None:
    import subprocess
    import sys

    log = _log(tmp_path)
    run = [sys.executable, "-m", "fedgpu.cli.app", "audit"]
    good = subprocess.run([*run, "verify", "--state-dir", str(tmp_path), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert good.returncode == 0 and json.loads(good.stdout)["head"] == \
        audit.verify(log.path).head
    lines = _lines(log.path)
    lines[1], lines[2] = lines[2], lines[1]
    log.path.write_bytes(b"".join(lines))
    bad = subprocess.run([*run, "verify", "--file", str(log.path)], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 1 and f"{log.path}:2:" in bad.stderr, bad.stderr
    shown = subprocess.run([*run, "show", "--state-dir", str(tmp_path), "--since", "1h",
                            "--json"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and len(json.loads(shown.stdout)) == 5
    later = subprocess.run([*run, "show", "--state-dir", str(tmp_path), "--since",
                            "2999-01-01"], capture_output=True, text=True, timeout=60)
    assert later.returncode == 0 and "no audit records" in later.stdout


def test_pages_join_into_the_chain_and_fetched_records_are_checked_here(
        tmp_path: Path) -> None:
    log = _log(tmp_path, n=7)
    records, after = [], -1
    while True:
        doc = audit.page(log.path, after, 3, check=True)
        records += doc["records"]
        assert doc["verdict"]["ok"]
        if doc["next_seq"] is None:
            break
        after = doc["next_seq"]
    assert [r["seq"] for r in records] == list(range(7))
    assert audit.verify_records(records, "remote").ok
    records[4]["actor"] = "mallory"
    problem = audit.verify_records(records, "remote").problem
    assert problem is not None and problem.line == 5 and "edited" in problem.reason
    del records[4]
    problem = audit.verify_records(records, "remote").problem
    assert problem is not None and problem.line == 5 and "out of chain" in problem.reason
