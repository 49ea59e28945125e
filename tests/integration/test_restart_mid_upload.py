"""An aggregator SIGKILLed in the middle of a site's upload and restarted on the same state
directory and port (issue 37.2), with real processes on loopback: it reopens the attempt it
was running (server/rounds/reopen.py), the cut site sends its kept update again and the site
accepted before the kill sends its kept copy (node/unacked.py): the round finishes as attempt 1,
each update is counted once, and no site trains twice for it.

The cut site talks to the aggregator through a fault proxy (tests/net/fault_proxy.py) that
slows its uploads to a trickle, so the kill lands while its update is on the way."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

from tests.fixtures.federation import Federation, base_env, cli, write_job
from tests.net.fault_proxy import FaultProxy, Way


def _node(fed: Federation, name: str, data: Path, tmp: Path, address: str):
    return fed.spawn(name, ["node", "start", "--aggregator", address, "--data", str(data),
                            "--name", name, "--torch-threads", "1", "--gpu", "none"],
                     env=base_env(FEDGPU_TOKEN=fed.token,
                                  FEDGPU_NODE_STATE=str(tmp / f"{name}-state")))


def _wait(cond, what: str, fed: Federation, timeout: float = 90) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"never: {what}\n{_logs(fed)}")


def _logs(fed: Federation) -> str:
    return "\n".join(f"--- {p.name}\n{p.text()[-2500:]}" for p in fed.procs)


def _alive(fed: Federation, *names: str) -> bool:
    try:
        nodes = {n["name"]: n for n in fed.query("ListNodes")["nodes"]}
    except Exception:  # noqa: BLE001 - the aggregator is still starting
        return False
    return all(nodes.get(n, {}).get("alive") for n in names)


def _job(fed: Federation, job_id: str) -> dict[str, Any] | None:
    try:
        doc = fed.query("GetJob", job_id=job_id)
    except Exception:  # noqa: BLE001 - between the kill and the restart
        return None
    return doc if doc["state"] in ("finished", "failed", "stopped") else None


def test_an_aggregator_killed_mid_upload_reopens_the_attempt_and_counts_each_update_once(
        federation: Federation, tmp_path: Path, digits_split: list[Path]) -> None:
    fed = federation
    # No bulk port: the cut site's upload goes over gRPC, through the proxy.
    fed.start_server(None, "--state-dir", str(tmp_path / "state"), "--heartbeat-s", "1",
                     "--bulk-port", "0")
    host, port = fed.address.rsplit(":", 1)
    with FaultProxy((host, int(port))) as proxy:
        a = _node(fed, "site-a", digits_split[0], tmp_path, f"127.0.0.1:{proxy.port}")
        b = _node(fed, "site-b", digits_split[1], tmp_path, fed.address)
        _wait(lambda: _alive(fed, "site-a", "site-b"), "both sites registered", fed)
        r = cli("job", "submit", str(write_job(tmp_path / "job.toml", rounds=1, min_nodes=2,
                                               round_deadline_s=60, name="killed-mid-upload")),
                "--address", fed.address, "--json")
        assert r.returncode == 0, r.stderr
        job_id = str(json.loads(r.stdout)["job_id"])
        # Once site-a starts training, its link carries 4 KB/s up: its ~150 KB update takes
        # half a minute, its heartbeats (a few hundred bytes) still go through.
        _wait(lambda: "round 1 train:" in a.text(), "site-a training", fed)
        proxy.slow(Way.UP, 4_000)
        _wait(lambda: "round 1 train done" in a.text(), "site-a trained", fed)
        sent = proxy.carried[Way.UP]
        _wait(lambda: "update for round 1 accepted" in b.text(), "site-b's update accepted", fed)
        _wait(lambda: proxy.carried[Way.UP] - sent > 8_000, "site-a's upload under way", fed)
        assert "update for round 1 accepted" not in a.text(), "the kill came too late"
        server = next(p for p in fed.procs if p.name == "aggregator")
        server.popen.send_signal(signal.SIGKILL)
        assert server.popen.wait(timeout=30) == -9
        proxy.slow(Way.UP, 0)
        fed.restart_server()
        final = _wait(lambda: _job(fed, job_id), "the job's end", fed)
    assert final["state"] == "finished" and final["rounds_done"] == 1, final
    server = next(p for p in fed.procs if p.name == "aggregator")
    assert "reopening attempt 1 after the restart" in server.text(), _logs(fed)
    records = [x for x in fed.query("ListRounds", job_id=job_id)["rounds"] if x["round"] == 1]
    assert [(x["attempt"], x["status"]) for x in records] == [(1, "finished")], records
    (rec,) = records
    # Each site's update counted once, with the examples it trained on.
    assert sorted(u["node"] for u in rec["updates"]) == ["site-a", "site-b"], rec
    assert rec["num_examples"] == sum(u["num_examples"] for u in rec["updates"])
    assert not [x for x in rec.get("rejected", []) if x["reason"] == "duplicate"], rec
    for site in (a, b):
        assert site.text().count("round 1 train done") == 1, site.text()[-3000:]
    # Site-b's copy was acknowledged before the kill: the reopened attempt asked for it again.
    assert "sending again the update kept for task" in b.text(), b.text()[-3000:]
