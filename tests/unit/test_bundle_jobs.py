"""Jobs with task bundles on the aggregator (server/jobs/queue.py, server/jobs/bundles.py)
and in the job file (fedgpu/core/job/): what is queued, kept, offered to nodes and refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedgpu.core.bundles import Bundle, open_archive, pack_files
from fedgpu.core.errors import ConfigError
from fedgpu.core.job import parse_job
from fedgpu.server.jobs.queue import JobError, JobManager
from fedgpu.server.jobs.store import JobStore
from fedgpu.server.registry import Registry


def make_bundle(name: str = "demo") -> Bundle:
    return open_archive(pack_files({
        "fedgpu-task.toml": f'name = "{name}"\nentry = "demo_task.model:DemoTask"\n'.encode(),
        "demo_task/model.py": b"class DemoTask:\n    name = 'demo'\n"}))


def manager(tmp_path: Path) -> JobManager:
    return JobManager(JobStore(tmp_path), Registry(), tmp_path, chunk_size=1 << 20)


def test_job_file_task_dir_rules() -> None:
    job = parse_job({"task_dir": "demo"}, "job.toml")
    assert job.task == "" and job.task_dir == "demo"
    with pytest.raises(ConfigError, match="'task' is required .* or 'task_dir'"):
        parse_job({"rounds": 2}, "job.toml")
    with pytest.raises(ConfigError, match="'task_dir' must be a directory"):
        parse_job({"task_dir": " "}, "job.toml")


def test_a_bundle_job_is_kept_offered_and_served_while_it_is_pending(tmp_path: Path) -> None:
    jobs = manager(tmp_path)
    b = make_bundle()
    row = jobs.intake.submit('task_dir = "demo"\nrounds = 2\n', "job.toml", "op", bundle=b)
    assert (row.task, row.bundle_sha256, row.bundle_size) == ("demo", b.sha256, b.size)
    assert (tmp_path / "bundles" / f"{b.sha256}.tar").read_bytes() == b.data
    [offer] = jobs.offers()
    assert (offer.sha256, offer.name, offer.entry, offer.job_id) == (
        b.sha256, "demo", "demo_task.model:DemoTask", row.job_id)
    header, data = jobs.bundle_for_node(b.sha256)
    assert data == b.data and header.size == b.size
    # The stored copy is checked every time it is served.
    (tmp_path / "bundles" / f"{b.sha256}.tar").write_bytes(b.data[:-1] + b"x")
    with pytest.raises(Exception, match="no longer matches its hash"):
        jobs.bundle_for_node(b.sha256)
    with pytest.raises(JobError, match="no job waiting or running here has bundle"):
        jobs.bundle_for_node("cd" * 32)
    jobs.stop(row.job_id)
    assert jobs.offers() == []
    with pytest.raises(JobError):
        jobs.bundle_for_node(b.sha256)


def test_bundle_jobs_refused_at_submit_queue_nothing(tmp_path: Path) -> None:
    jobs = manager(tmp_path)
    with pytest.raises(ConfigError, match="no bundle came with the job"):
        jobs.intake.submit('task_dir = "demo"\n', "job.toml", "op")
    with pytest.raises(ConfigError, match="'task' is 'digits' but the task bundle is named "
                                          "'demo'"):
        jobs.intake.submit('task = "digits"\n', "job.toml", "op", bundle=make_bundle())
    assert jobs.store.jobs() == [] and not (tmp_path / "bundles").exists()
