"""Restarts keep sites (issue 36.1), with real processes on loopback: the aggregator SIGTERMed
and SIGKILLed, again and again, under a running job, and every node stays and the job
finishes; a site that has not come back after a restart is listed as `lost` with its last-seen
time and named by the job that waits for it; only a retirement (`fedgpu nodes forget`,
`fedgpu server stop --retire-nodes`) makes a node exit."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

from tests.fixtures.federation import Federation, base_env, cli, write_job


def _node(fed: Federation, name: str, data: Path, tmp: Path):
    # Each with a state directory of its own: its identity survives its own restarts.
    return fed.spawn(name, ["node", "start", "--aggregator", fed.address, "--data", str(data),
                            "--name", name, "--torch-threads", "1", "--gpu", "none"],
                     env=base_env(FEDGPU_TOKEN=fed.token,
                                  FEDGPU_NODE_STATE=str(tmp / f"{name}-state")))


def _wait(cond, what: str, fed: Federation, timeout: float = 120) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    logs = "\n".join(f"--- {p.name}\n{p.text()[-2000:]}" for p in fed.procs)
    raise AssertionError(f"never: {what}\n{logs}")


def _nodes(fed: Federation) -> dict[str, dict[str, Any]]:
    return {n["name"]: n for n in fed.query("ListNodes")["nodes"]}


def _alive(fed: Federation, *names: str) -> bool:
    try:
        nodes = _nodes(fed)
    except Exception:  # noqa: BLE001 - the aggregator is still starting
        return False
    return all(nodes.get(n, {}).get("alive") for n in names)


def _rounds(fed: Federation, job_id: str) -> int:
    try:
        return int(fed.query("GetJob", job_id=job_id)["rounds_done"])
    except Exception:  # noqa: BLE001 - between a kill and the restart
        return -1


def _submit(fed: Federation, job: Path) -> str:
    r = cli("job", "submit", str(job), "--address", fed.address, "--json")
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["job_id"])


def test_sigterm_and_sigkill_restarts_under_a_job_keep_every_node(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    fed = federation
    fed.start_server(None, "--state-dir", str(tmp_path / "state"), "--heartbeat-s", "1")
    sites = [_node(fed, f"site-{c}", digits_split[i], tmp_path) for i, c in enumerate("abc")]
    names = [s.name for s in sites]
    _wait(lambda: _alive(fed, *names), "three sites registered", fed)
    pids = {s.name: s.popen.pid for s in sites}
    job_id = _submit(fed, write_job(tmp_path / "job.toml", rounds=12, min_nodes=3,
                                    name="through-restarts"))
    done = 0
    for sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGTERM):
        # Each time in the middle of the job: at least one more round since the last restart.
        done = _wait(lambda d=done: (r := _rounds(fed, job_id)) > d and r, "a round", fed,
                     timeout=240)
        assert done < 12, "the job ended before the restarts were done: make it longer"
        server = next(p for p in fed.procs if p.name == "aggregator")
        server.popen.send_signal(sig)
        assert server.popen.wait(timeout=30) == (0 if sig == signal.SIGTERM else -9)
        if sig == signal.SIGTERM:
            assert "nodes keep their registration" in server.text()
        fed.restart_server()
    final = _wait(lambda: (d := fed.query("GetJob", job_id=job_id))["state"] in
                  ("finished", "failed", "stopped") and d, "the job's end", fed, timeout=420)
    assert final["state"] == "finished" and final["rounds_done"] == 12, final
    # The same node processes, still up, never told the run is over.
    for s in sites:
        assert s.popen.poll() is None, s.text()[-2000:]
        assert "retired" not in s.text() and "run is over" not in s.text()
        assert "registering again" in s.text()
    assert {s.name: s.popen.pid for s in sites} == pids
    assert _alive(fed, *names)


def test_a_site_that_does_not_come_back_is_lost_and_named_and_forget_retires(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    fed = federation
    fed.start_server(None, "--state-dir", str(tmp_path / "state"), "--heartbeat-s", "1")
    a = _node(fed, "site-a", digits_split[0], tmp_path)
    b = _node(fed, "site-b", digits_split[1], tmp_path)
    _wait(lambda: _alive(fed, "site-a", "site-b"), "two sites registered", fed)
    b.stop()
    assert b.popen.returncode == 0
    stopped_at = time.time()
    server = next(p for p in fed.procs if p.name == "aggregator")
    server.popen.send_signal(signal.SIGTERM)
    server.popen.wait(timeout=30)
    fed.restart_server()
    _wait(lambda: _alive(fed, "site-a"), "site-a back", fed)

    # site-b's record survived the restart: lost, with when it was last seen.
    lost = _nodes(fed)["site-b"]
    assert lost["state"] == "lost" and lost["alive"] is False
    assert stopped_at - 30 < lost["last_seen_at"] <= stopped_at + 1
    r = cli("nodes", "--address", fed.address)
    assert r.returncode == 0 and "site-b" in r.stdout and "lost " in r.stdout, r.stdout

    # A job that needs both waits, and names the site it waits for.
    job_id = _submit(fed, write_job(tmp_path / "job.toml", rounds=1, min_nodes=2))
    reason = _wait(lambda: (d := fed.query("GetJob", job_id=job_id))["state"] == "waiting"
                   and d["reason"], "the job waiting", fed)
    assert "site-b" in reason and "lost since" in reason, reason
    r = cli("job", "status", job_id, "--address", fed.address)
    assert "site-b" in r.stdout and "lost since" in r.stdout, r.stdout + r.stderr

    # Forgetting the lost one removes it (by a unique prefix of its name).
    r = cli("nodes", "forget", "site-b", "--address", fed.address)
    assert r.returncode == 0 and "retired node site-b" in r.stdout, r.stderr
    assert "site-b" not in _nodes(fed)
    # A live node only with --force; it is told it is retired and exits, cleanly.
    a_id = _nodes(fed)["site-a"]["node_id"]
    r = cli("nodes", "forget", a_id[:-2], "--address", fed.address)
    assert r.returncode != 0 and "alive" in r.stderr, r.stderr
    r = cli("nodes", "forget", a_id[:-2], "--force", "--address", fed.address)
    assert r.returncode == 0, r.stderr
    assert a.popen.wait(timeout=60) == 0, a.text()[-2000:]
    assert "retired this node" in a.text()
    # The retired site, started again with its identity, is refused and exits saying so.
    again = _node(fed, "site-a", digits_split[0], tmp_path)
    assert again.popen.wait(timeout=60) == 0, again.text()[-2000:]
    assert "retired" in again.text() and "another --name" in again.text()
    # site-b, which never heard it was forgotten, hears it when it comes back.
    b_again = _node(fed, "site-b", digits_split[1], tmp_path)
    assert b_again.popen.wait(timeout=60) == 0, b_again.text()[-2000:]
    assert "retired" in b_again.text()


def test_server_stop_keeps_nodes_unless_it_retires_them(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    fed = federation
    fed.start_server(None, "--state-dir", str(tmp_path / "state"), "--heartbeat-s", "1")
    a = _node(fed, "site-a", digits_split[0], tmp_path)
    _wait(lambda: _alive(fed, "site-a"), "site-a registered", fed)
    server = next(p for p in fed.procs if p.name == "aggregator")
    r = cli("server", "stop", "--address", fed.address)
    assert r.returncode == 0 and "keep their registration" in r.stdout, r.stderr
    assert server.popen.wait(timeout=30) == 0
    fed.restart_server()
    _wait(lambda: _alive(fed, "site-a"), "site-a back", fed)
    assert a.popen.poll() is None

    # A node's token may not stop the federation.
    r = cli("server", "stop", "--address", fed.address, operator_token=fed.token)
    assert r.returncode != 0
    server = next(p for p in fed.procs if p.name == "aggregator")
    r = cli("server", "stop", "--retire-nodes", "--address", fed.address)
    assert r.returncode == 0 and "retired" in r.stdout, r.stderr
    assert server.popen.wait(timeout=30) == 0
    assert a.popen.wait(timeout=60) == 0, a.text()[-2000:]
    assert "retired this node" in a.text()
    # Retired with the federation: not listed as lost at the next start.
    fed.restart_server()
    assert _nodes(fed) == {}


def test_a_node_that_only_heartbeats_is_not_sampled(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    """A site whose task loop is stuck still heartbeats: it must not be sampled (and hold up
    or fail the round for everyone); `job status` says why it is left out."""
    import threading

    import grpc

    from fedgpu.core.transport import token_metadata
    from fedgpu.proto import pb, pb_grpc
    from fedgpu.server.registry import LOOP_GRACE_S

    fed = federation
    fed.start_server(None, "--state-dir", str(tmp_path / "state"), "--heartbeat-s", "1")
    _node(fed, "site-a", digits_split[0], tmp_path)
    stop = threading.Event()
    with grpc.insecure_channel(fed.address) as ch:
        stub = pb_grpc.FederationStub(ch)
        md = token_metadata(fed.token)
        reg = stub.Register(pb.RegisterRequest(node_name="stuck", tasks=["digits"]),
                            metadata=md, timeout=10)

        def beat() -> None:
            while not stop.wait(0.5):
                stub.Heartbeat(pb.HeartbeatRequest(node_id=reg.node_id, state="idle"),
                               metadata=md, timeout=5)

        beater = threading.Thread(target=beat, daemon=True)
        beater.start()
        try:
            _wait(lambda: _alive(fed, "site-a", "stuck"), "both registered", fed)
            time.sleep(LOOP_GRACE_S + 1)  # its loop has now been quiet for longer than that
            assert _nodes(fed)["stuck"]["alive"] is True  # it heartbeats
            job_id = _submit(fed, write_job(tmp_path / "job.toml", rounds=2, min_nodes=1,
                                            fraction=1.0, round_deadline_s=600))
            done = _wait(lambda: (d := fed.query("GetJob", job_id=job_id))["state"] in
                         ("finished", "failed", "stopped") and d, "the job's end", fed,
                         timeout=300)
            assert done["state"] == "finished", done
            rounds = fed.query("ListRounds", job_id=job_id)["rounds"]
            assert rounds and all("stuck" not in json.dumps(r["participants"]) for r in rounds)
            # A job that needs both waits, and says why the stuck one is left out.
            two = _submit(fed, write_job(tmp_path / "two.toml", rounds=1, min_nodes=2))
            doc = _wait(lambda: (d := fed.query("GetJob", job_id=two))["state"] == "waiting"
                        and d, "the second job waiting", fed)
            why = {n["name"]: n["reason"] for n in doc["nodes"]}
            assert "task loop has not asked for work" in (why["stuck"] or ""), why
            assert why["site-a"] is None, why
            assert "stuck: its task loop" in doc["reason"], doc["reason"]
        finally:
            stop.set()
            beater.join(timeout=10)
