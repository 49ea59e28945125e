"""A site's allow-list and bundle cache (node/approvals.py), the agent's consent rules
(node/bundle_keeper.py) and the aggregator's view of them (server/rounds/eligibility.py).

The keeper gets its bundle bytes from a plain function here (what the gRPC client's
fetch_bundle is in the agent); the integration tests fetch them from a real aggregator."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fedgpu.core.bundles import Bundle, BundleError, open_archive, pack_files
from fedgpu.core.constants import BundleState, TaskApproval
from fedgpu.core.job import Job
from fedgpu.node.approvals import SiteTasks
from fedgpu.node.bundle_keeper import BundleKeeper
from fedgpu.proto import pb
from fedgpu.server.registry import Registry
from fedgpu.server.rounds.eligibility import eligibility


def make_bundle(model: str = "class DemoTask:\n    name = 'demo'\n",
                requires: str = "[]") -> Bundle:
    return open_archive(pack_files({
        "fedgpu-task.toml": (f'name = "demo"\nentry = "demo_task.model:DemoTask"\n'
                             f"requires = {requires}\n").encode(),
        "demo_task/model.py": model.encode()}))


def offer(bundle: Bundle, job: str = "job1") -> pb.TaskBundle:
    return pb.TaskBundle(sha256=bundle.sha256, size=bundle.size, name=bundle.manifest.name,
                         entry=bundle.manifest.entry, job_id=job)


def keeper(tmp_path: Path, mode: TaskApproval, *served: Bundle) -> BundleKeeper:
    by_hash = {b.sha256: b.data for b in served}
    return BundleKeeper(mode, tmp_path / "state", lambda sha: by_hash[sha])


def wait_for(predicate, timeout: float = 10.0) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.02)


# ---- the site's files --------------------------------------------------------------------


def test_decisions_replace_each_other_and_are_listed(tmp_path: Path) -> None:
    site = SiteTasks(tmp_path)
    b = make_bundle()
    assert site.state(b.sha256) is None
    site.keep(b, "job1")
    assert site.state(b.sha256) is BundleState.PENDING
    site.approve(b.sha256, "hash")
    assert site.state(b.sha256) is BundleState.APPROVED
    site.reject(b.sha256, "hash")
    assert site.state(b.sha256) is BundleState.REJECTED
    assert not (tmp_path / "approved" / b.sha256).exists()
    [record] = site.records()
    doc = record.to_dict()
    assert doc["state"] == "rejected" and doc["name"] == "demo" and doc["job"] == "job1"
    assert doc["size"] == b.size and doc["archive"].endswith(f"{b.sha256}.tar")
    assert doc["first_seen"] > 0 and doc["decided_at"] >= doc["first_seen"]


def test_a_hash_approved_before_it_was_ever_seen_is_listed(tmp_path: Path) -> None:
    site = SiteTasks(tmp_path)
    sha = "ab" * 32
    site.approve(sha, "hash")
    [record] = site.records()
    assert record.state is BundleState.APPROVED and record.name is None
    assert site.resolve("abababab") == sha
    with pytest.raises(BundleError, match="at least its first 8"):
        site.resolve("abab")
    with pytest.raises(BundleError, match="names 0 bundles"):
        site.resolve("cdcdcdcd")
    with pytest.raises(BundleError, match="64 hexadecimal"):
        site.approve("not-a-hash", "hash")


def test_a_cached_copy_changed_on_disk_is_refused_and_removed(tmp_path: Path) -> None:
    site = SiteTasks(tmp_path)
    b = make_bundle()
    path = site.keep(b, "job1")
    assert site.cached(b.sha256) == b.data
    data = bytearray(path.read_bytes())
    data[520] ^= 1  # one bit of the model's source (the first member, after its header)
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="no longer matches its hash"):
        site.cached(b.sha256)
    assert not path.exists() and site.cached(b.sha256) is None


# ---- the agent's consent --------------------------------------------------------------------


def test_installed_mode_refuses_naming_the_mode(tmp_path: Path) -> None:
    b = make_bundle()
    k = keeper(tmp_path, TaskApproval.INSTALLED, b)
    section, why = k.prepare(offer(b))
    assert section is None and "--task-approval installed" in why and b.sha256 in why
    assert k.answer([offer(b)]) == []  # nothing fetched, nothing to say
    assert not (tmp_path / "state").exists()


def test_approved_mode_waits_for_the_site_then_runs_the_checked_copy(tmp_path: Path) -> None:
    b = make_bundle()
    k = keeper(tmp_path, TaskApproval.APPROVED, b)
    [status] = k.answer([offer(b)])
    assert (status.sha256, status.state) == (b.sha256, "pending")
    # The offer is fetched in the background, checked and kept as pending at the site.
    # The archive is written before its state is recorded: wait for both.
    wait_for(lambda: k.site.archive_path(b.sha256).exists()
             and k.site.state(b.sha256) is BundleState.PENDING)
    section, why = k.prepare(offer(b))
    assert section is None
    assert why == (f"bundle {b.sha256} (task 'demo') is not approved at this site "
                   f"(--task-approval approved): review it, then run 'fedgpu node approve "
                   f"{b.sha256}' there")
    k.site.approve(b.sha256, "hash")  # what `fedgpu node approve` writes: seen at once
    assert [s.state for s in k.answer([offer(b)])] == ["approved"]
    section, why = k.prepare(offer(b))
    assert why == "" and section == {"bundle": {
        "path": str(k.site.archive_path(b.sha256)), "sha256": b.sha256, "name": "demo",
        "entry": "demo_task.model:DemoTask"}}
    k.site.reject(b.sha256, "hash")
    section, why = k.prepare(offer(b))
    assert section is None and "was rejected at this site" in why
    assert [s.state for s in k.answer([offer(b)])] == ["rejected"]


def test_any_mode_runs_every_bundle(tmp_path: Path) -> None:
    b = make_bundle()
    k = keeper(tmp_path, TaskApproval.ANY, b)
    section, why = k.prepare(offer(b))
    assert why == "" and section is not None
    assert "EVERY task bundle" in k.start_line()


def test_a_requirement_the_node_lacks_makes_the_bundle_unusable(tmp_path: Path) -> None:
    b = make_bundle(requires='["surely-not-installed-dist>=1"]')
    k = keeper(tmp_path, TaskApproval.ANY, b)
    k.answer([offer(b)])
    wait_for(lambda: k.answer([offer(b)])[0].state == "unusable")
    [status] = k.answer([offer(b)])
    assert "surely-not-installed-dist" in status.reason and "not installed" in status.reason
    # Kept all the same: the site sees what it was sent.
    assert k.site.records()[0].name == "demo"
    section, why = k.prepare(offer(b))
    assert section is None and "surely-not-installed-dist" in why


def test_a_tampered_cache_refuses_the_task_and_is_fetched_afresh(tmp_path: Path) -> None:
    b = make_bundle()
    k = keeper(tmp_path, TaskApproval.ANY, b)
    assert k.prepare(offer(b))[1] == ""
    path = k.site.archive_path(b.sha256)
    path.write_bytes(path.read_bytes().replace(b"'demo'", b"'evil'"))
    section, why = k.prepare(offer(b))
    assert section is None and "no longer matches its hash" in why
    # Removed with the refusal: the next task fetches and checks it again.
    assert k.prepare(offer(b))[1] == "" and k.site.cached(b.sha256) == b.data


def test_a_bundle_whose_manifest_disagrees_with_the_task_is_refused(tmp_path: Path) -> None:
    b = make_bundle()
    k = keeper(tmp_path, TaskApproval.ANY, b)
    lying = offer(b)
    lying.name = "other"
    section, why = k.prepare(lying)
    assert section is None and "its manifest says 'demo'" in why


# ---- what the aggregator makes of it ---------------------------------------------------------


def test_eligibility_follows_the_sites_answers() -> None:
    b = make_bundle()
    ref = b.ref()
    job = Job(task="demo")
    node = Registry().register("n1", "peer", "v", {}, {}, {}, ["digits"])
    assert "--task-approval installed" in eligibility(job, node, True, ref)
    node.task_approval = "approved"
    assert "has not answered" in eligibility(job, node, True, ref)
    node.bundle_states = {b.sha256: ("pending", "")}
    assert f"'fedgpu node approve {b.sha256}'" in eligibility(job, node, True, ref)
    node.bundle_states = {b.sha256: ("rejected", "")}
    assert "rejected" in eligibility(job, node, True, ref)
    node.bundle_states = {b.sha256: ("approved", "")}
    assert eligibility(job, node, True, ref) is None
    assert eligibility(job, node, False, ref).startswith("lost since ")
    node.task_approval = "any"
    node.bundle_states = {b.sha256: ("unusable", "needs scipy")}
    assert "needs scipy" in eligibility(job, node, True, ref)
    node.bundle_states = {}
    assert eligibility(job, node, True, ref) is None
    # The task's name is the bundle's: an installed task list does not matter to it, and an
    # installed task's job still needs the task installed.
    assert "not installed there" in eligibility(job, node, True, None)
