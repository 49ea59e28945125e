"""Which queued job starts when several may run at once (server/jobs/scheduling.py), and who
holds which site (server/jobs/seats.py), on a real job store, registry and studies: the
queue's decisions without running rounds (tests/integration/test_studies.py runs them).

Threat model: none beyond correctness: a job must never be sampled onto a site another running
job holds, and a job must not be starved by the ones queued behind it.
"""

from __future__ import annotations

import time
from pathlib import Path

from fedgpu.server.jobs import scheduling
from fedgpu.server.jobs.job_engine import job_from_row
from fedgpu.server.jobs.queue import JobManager
from fedgpu.server.jobs.seats import JobRoster, Seats
from fedgpu.server.jobs.store import JobStore
from fedgpu.server.registry import Registry
from fedgpu.server.studies import Studies


def _manager(tmp_path: Path, *sites: str) -> JobManager:
    registry = Registry()
    for name in sites:
        node = registry.register(name, "peer", "0", {}, {}, {}, ["digits"])
        node.loop_seen = time.time()
    studies = Studies(tmp_path)
    return JobManager(JobStore(tmp_path), registry, tmp_path, chunk_size=1 << 20,
                      studies=studies, max_concurrent=2)


def _queue(jobs: JobManager, study: str | None, min_nodes: int = 1) -> str:
    line = f'study = "{study}"\n' if study else ""
    row = jobs.intake.submit(f'task = "digits"\n{line}min_nodes = {min_nodes}\n',
                             "job.toml", "test")
    return row.job_id


def test_a_site_is_held_by_one_job_until_it_ends() -> None:
    registry = Registry()
    site = registry.register("site-a", "peer", "0", {}, {}, {}, ["digits"])
    seats = Seats()
    first, second = JobRoster("j1", seats), JobRoster("j2", seats)
    assert first.refusal(None, site) is None and second.refusal(None, site) is None
    first.claim([site])
    assert first.refusal(None, site) is None
    assert second.refusal(None, site) == "busy with job j1"
    assert seats.release("j1") == ["site-a"]
    assert second.refusal(None, site) is None


def test_a_site_with_two_slots_takes_two_jobs_and_names_its_slots_when_full(
        tmp_path: Path) -> None:
    jobs = _manager(tmp_path, "site-a")
    site = jobs.registry.all()[0]
    site.slots = 2  # as it advertised at registration (fedgpu node start --slots 2)
    first, second, third = (_queue(jobs, None), _queue(jobs, None), _queue(jobs, None))
    jobs.seats.claim(first, [site])
    # One slot left: the second job may sample the site beside the first.
    assert jobs.roster(second).refusal(None, site) is None
    pending = [r for r in jobs.store.pending() if r.job_id != first]
    row, blocked = scheduling.next_job(pending, jobs, job_from_row)
    assert row is not None and row.job_id == second and blocked == {}
    jobs.seats.claim(second, [site])
    # Both slots held: the third waits, naming both jobs and the site's slots.
    assert (jobs.roster(third).refusal(None, site)
            == f"its 2 slots are busy with jobs {first}, {second}")
    pending = [r for r in jobs.store.pending() if r.job_id not in (first, second)]
    row, blocked = scheduling.next_job(pending, jobs, job_from_row)
    assert row is None
    both = ", ".join(sorted((first, second)))
    assert blocked == {third: f"needs 1 sites; 1 busy with job {both} (site-a: 2 of 2 slots)"}
    # A job ending frees its slot for the third.
    jobs.seats.release(first)
    assert jobs.roster(third).refusal(None, site) is None


def test_a_job_whose_sites_are_busy_waits_and_says_which_job_holds_them(
        tmp_path: Path) -> None:
    jobs = _manager(tmp_path, "site-a", "site-b", "site-c")
    for study, sites in (("onco", ["site-a", "site-b"]), ("cardio", ["site-c"])):
        jobs.studies.create(study)  # type: ignore[union-attr]
        jobs.studies.enrol(study, sites)  # type: ignore[union-attr]
    onco_1, onco_2, cardio = (_queue(jobs, "onco", 2), _queue(jobs, "onco", 2),
                              _queue(jobs, "cardio"))
    by_name = {n.name: n for n in jobs.registry.all()}
    # onco_1 runs and has sampled both onco sites.
    jobs.seats.claim(onco_1, [by_name["site-a"], by_name["site-b"]])
    pending = [r for r in jobs.store.pending() if r.job_id != onco_1]
    row, blocked = scheduling.next_job(pending, jobs, job_from_row)
    # The second onco job waits, naming the job; the cardio job, on other sites, starts.
    assert row is not None and row.job_id == cardio
    assert blocked == {onco_2: f"needs 2 sites of study onco; 2 busy with job {onco_1} "
                               "(site-a: 1 of 1 slot; site-b: 1 of 1 slot)"}


def test_a_later_job_does_not_take_the_sites_an_earlier_waiting_job_needs(
        tmp_path: Path) -> None:
    jobs = _manager(tmp_path, "site-a", "site-b")
    running, big, small = _queue(jobs, None, 1), _queue(jobs, None, 2), _queue(jobs, None, 1)
    node_a = next(n for n in jobs.registry.all() if n.name == "site-a")
    jobs.seats.claim(running, [node_a])
    pending = [r for r in jobs.store.pending() if r.job_id != running]
    row, blocked = scheduling.next_job(pending, jobs, job_from_row)
    # `small` could run on site-b, but `big` (before it) needs site-b too: nothing starts.
    assert row is None
    assert blocked[big] == f"needs 2 sites; 1 busy with job {running} (site-a: 1 of 1 slot)"
    assert "waits behind an earlier job" in blocked[small]
