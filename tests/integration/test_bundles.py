"""Task bundles shipped with jobs (issue 15), with real processes on loopback: a task written
with `fedgpu task new`, checked with `fedgpu task check`, submitted with `--task-dir` to an
aggregator whose nodes have never seen it; it waits for each site's approval, runs once both
approved it, and a one-byte change makes it a bundle to approve again."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil

from tests.fixtures.federation import FEDGPU, ROOT, Federation, base_env, cli, write_job
from tests.integration.test_jobs import job_cli, wait_job


def site_tasks(state: Path) -> list[dict[str, Any]]:
    r = cli("node", "tasks", "--state-dir", str(state), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def wait_until(what: str, check: Any, timeout: float = 120) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"never: {what}")


def pending_at(state: Path, sha: str) -> dict[str, Any] | None:
    return next((t for t in site_tasks(state) if t["sha256"] == sha
                 and t["state"] == "pending"), None)


def test_a_bundle_job_waits_for_each_site_then_runs_and_a_changed_one_waits_again(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    fed = federation
    work = tmp_path / "work"
    work.mkdir()
    r = cli("task", "new", "demo", "--dir", str(work / "demo"))
    assert r.returncode == 0, r.stderr
    r = cli("task", "check", str(work / "demo"), "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    checked = json.loads(r.stdout)
    sha = checked["sha256"]
    assert set(checked["rounds"]) == {"init", "train", "evaluate"}
    assert checked["rounds"]["train"]["train_metrics"]["loss"] > 0

    fed.start_server(None, "--state-dir", str(tmp_path / "aggregator"), "--heartbeat-s", "1")
    states = {name: tmp_path / f"{name}-state" for name in ("site-a", "site-b", "site-c")}
    for name in ("site-a", "site-b"):
        fed.start_node(name, digits_split[0 if name == "site-a" else 1], "--gpu", "none",
                       "--task-approval", "approved", "--state-dir", str(states[name]))
    # A site that runs installed tasks only: never sampled for a bundle job, and says why.
    fed.start_node("site-c", digits_split[2], "--gpu", "none", "--task-approval", "installed",
                   "--state-dir", str(states["site-c"]))
    job = write_job(work / "job.toml", task="demo", task_dir="demo", rounds=2,
                    hyperparameters={"lr": 0.05})

    submitted = job_cli(fed, "submit", str(job))
    assert (submitted["bundle_sha256"], submitted["bundle_name"]) == (sha, "demo")
    assert submitted["bundle_size"] == checked["size"]
    job_id = submitted["job_id"]

    # Both sites are offered the bundle, fetch it, and list it pending with that very hash.
    for name in ("site-a", "site-b"):
        listed = wait_until(f"{name} lists the bundle pending",
                            lambda n=name: pending_at(states[n], sha))
        assert (listed["name"], listed["job"], listed["size"]) == ("demo", job_id,
                                                                  checked["size"])
        assert listed["entry"] == checked["entry"]
    assert site_tasks(states["site-c"]) == []

    def status_when(ok: Any, of: str = job_id) -> dict[str, Any]:
        return wait_until("job status", lambda: (lambda d: d if ok(d) else None)(
            job_cli(fed, "status", of)))

    waiting = status_when(lambda d: d["state"] == "waiting" and all(
        "fedgpu node approve" in (n["reason"] or "") for n in d["nodes"]
        if n["name"] != "site-c"))
    assert "0 of the 2 nodes it needs can take it" in waiting["reason"]
    why = {n["name"]: n["reason"] for n in waiting["nodes"]}
    for name in ("site-a", "site-b"):
        assert f"'fedgpu node approve {sha}' there" in why[name], why
    assert "--task-approval installed" in why["site-c"], why
    # Waiting costs no round: none was opened, so none can have burnt a retry.
    assert waiting["current_round"] is None and waiting["rounds_done"] == 0
    rounds = json.loads(cli("rounds", "--address", fed.address, "--job", job_id,
                            "--json").stdout)
    assert rounds["rounds"] == []

    # One site approves by (a prefix of) the hash, the other from the sources it reviewed.
    r = cli("node", "approve", sha[:12], "--state-dir", str(states["site-a"]))
    assert r.returncode == 0 and f"approved bundle {sha} (task 'demo')" in r.stdout, r.stderr
    still = status_when(lambda d: "1 of the 2 nodes" in (d["reason"] or ""))
    assert still["state"] == "waiting" and still["rounds_done"] == 0
    r = cli("node", "approve", str(work / "demo"), "--state-dir", str(states["site-b"]),
            "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["state"] == "approved", r.stderr

    done = wait_job(fed, job_id, ("finished", "failed", "stopped"))
    assert done["state"] == "finished", done
    [listed_job] = job_cli(fed, "list")
    assert listed_job["rounds_done"] == 2 and listed_job["accuracy"] is not None
    assert listed_job["bundle_sha256"] == sha
    for name in ("site-a", "site-b"):
        assert [t["state"] for t in site_tasks(states[name])] == ["approved"]
    # Each site's audit log holds its approval and the rounds it ran for the aggregator.
    from fedgpu.core import audit

    log_a = states["site-a"] / audit.AUDIT_FILE
    records = list(audit.read(log_a))
    assert audit.verify(log_a).ok
    assert [r["target"] for r in records if r["action"] == "bundle.approve"] == [sha]
    ran = [r for r in records if r["action"] == "task.train"]
    assert any(r["outcome"] == "OK" for r in ran), records
    assert all(r["actor"].startswith("aggregator ") for r in ran)

    # One byte changed in one source file: another hash, waiting for approval again.
    source = work / "demo" / "demo_task" / "task.py"
    text = source.read_text()
    assert text.count('"lr": 0.05') == 1
    source.write_text(text.replace('"lr": 0.05', '"lr": 0.06'))
    # Its hash as packed for a job (`task check` printed the first one above; running it again
    # would train and evaluate the task once more only to print the second).
    from fedgpu.core import bundles

    changed = bundles.pack_dir(work / "demo").sha256
    assert changed != sha
    second = job_cli(fed, "submit", str(job))
    assert second["bundle_sha256"] == changed
    wait_until("site-a lists the changed bundle pending",
               lambda: pending_at(states["site-a"], changed))
    status_when(lambda d: d["state"] == "waiting" and all(
        f"'fedgpu node approve {changed}'" in (n["reason"] or "")
        for n in d["nodes"] if n["name"] != "site-c"), second["job_id"])
    by_sha = {t["sha256"]: t["state"] for t in site_tasks(states["site-a"])}
    assert by_sha == {sha: "approved", changed: "pending"}
    # A site may refuse it; the job keeps waiting with that reason.
    assert cli("node", "reject", changed, "--state-dir", str(states["site-b"])).returncode == 0
    status_when(lambda d: any("the site rejected bundle" in (n["reason"] or "")
                              for n in d["nodes"] if n["name"] == "site-b"), second["job_id"])
    job_cli(fed, "stop", second["job_id"])
    assert wait_job(fed, second["job_id"], ("stopped",))["rounds_done"] == 0


def test_bundle_code_is_imported_only_in_round_workers(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    fed = federation
    task = tmp_path / "marked"
    (task / "marked_task").mkdir(parents=True)
    (task / "fedgpu-task.toml").write_text('name = "marked"\n'
                                           'entry = "marked_task.model:MarkedTask"\n')
    (task / "marked_task" / "__init__.py").write_text("")
    (task / "marked_task" / "model.py").write_text(
        "import os\n\n"
        "from fedgpu.node.tasks.digits import DigitsTask\n\n"
        "with open(os.environ['BUNDLE_MARKER'], 'a') as fh:\n"
        "    fh.write(f'{os.getpid()}\\n')\n\n\n"
        "class MarkedTask(DigitsTask):\n"
        "    name = 'marked'\n")
    marker = tmp_path / "imported-by"
    fed.start_server(None, "--state-dir", str(tmp_path / "aggregator"), "--heartbeat-s", "1")
    # --task-approval any, as `fedgpu run` starts its nodes: no approval needed, said loudly.
    node = fed.start_node("site-a", digits_split[0], "--gpu", "none", "--task-approval", "any",
                          "--state-dir", str(tmp_path / "site-a-state"),
                          env=base_env(FEDGPU_TOKEN=fed.token, BUNDLE_MARKER=str(marker)))
    factory = wait_until("the node's worker factory runs", lambda: [
        p.pid for p in psutil.Process(node.popen.pid).children(recursive=True)
        if "fedgpu.node.rounds.factory" in " ".join(p.cmdline())])
    job = write_job(tmp_path / "job.toml", task=None, task_dir="marked", min_nodes=1, rounds=1)
    submitted = job_cli(fed, "submit", str(job))
    done = wait_job(fed, submitted["job_id"], ("finished", "failed", "stopped"))
    assert done["state"] == "finished", done
    pids = [int(p) for p in marker.read_text().split()]
    # init, train, evaluate: three rounds, each a worker process of its own importing it;
    # never the agent, never the factory the workers are forked from.
    assert len(pids) == 3 and len(set(pids)) == 3, pids
    assert node.popen.pid not in pids and not set(factory) & set(pids), (pids, factory)
    assert os.getpid() not in pids
    assert "--task-approval any: this node runs EVERY task bundle" in node.text()


def test_fedgpu_run_runs_a_bundle_job_on_nodes_that_take_any(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    assert cli("task", "new", "demo", "--dir", str(work / "demo")).returncode == 0
    job = write_job(work / "job.toml", task=None, task_dir="demo", rounds=1, min_nodes=2)
    run_dir = tmp_path / "run"
    # The run copies the job file into its own directory: task_dir still finds the sources.
    r = subprocess.run([*FEDGPU, "run", "--nodes", "2", "--job", str(job), "--run-dir",
                        str(run_dir)], capture_output=True, text=True, env=base_env(),
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"round 1/1: finished, train loss [\d.]+, 2/2 nodes", r.stdout), r.stdout
    (archive,) = (run_dir / "state" / "bundles").glob("*.tar")
    node_log = (run_dir / "logs" / "node-1.log").read_text()
    assert "--task-approval any: this node runs EVERY task bundle" in node_log
    assert f"running task bundle {archive.stem} (task 'demo') without the site's approval" \
        in node_log
