"""What an operator looks at, against one real run (a real aggregator and real nodes): the
report read back and compared with `fedgpu rounds --json`, and the Prometheus endpoint
scraped and compared with the admin documents."""

from __future__ import annotations

import json
import re
import struct
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.federation import FEDGPU, ROOT, Federation, base_env, free_port, write_job
from tests.fixtures.federation import cli as fixture_cli

PLOTS = ("global.png", "node_accuracy.png", "node_memory.png", "round_time.png")


def cli(*args: str, token: str | None = "test-token") -> subprocess.CompletedProcess[str]:
    return fixture_cli(*args, token=token, timeout=120)


@dataclass
class FinishedRun:
    fed: Federation
    state_dir: Path
    rounds: dict[str, Any]
    metrics_port: int
    # `fedgpu status --watch` (human, and --json) started before the first node joined.
    watch: subprocess.CompletedProcess[str]
    watch_json: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory,
                 digits_split: list[Path]) -> Iterator[FinishedRun]:
    tmp = tmp_path_factory.mktemp("report-run")
    fed = Federation(tmp)
    try:
        state = tmp / "state"
        metrics_port = free_port()
        fed.start_server(write_job(tmp / "job.toml", rounds=3, min_nodes=2), "--heartbeat-s",
                         "1", "--state-dir", str(state), "--metrics-port", str(metrics_port))
        watchers = [subprocess.Popen(
            [*FEDGPU, "status", "--address", fed.address, "--watch", "--interval", "0.5",
             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=base_env(FEDGPU_TOKEN=fed.token), cwd=ROOT) for extra in ([], ["--json"])]
        fed.start_node("node-a", digits_split[0], "--gpu", "none")
        fed.start_node("node-b", digits_split[1], "--gpu", "none")
        assert fed.wait_state(("finished", "failed"))["state"] == "finished"
        done = []
        for w in watchers:
            out, err = w.communicate(timeout=60)
            done.append(subprocess.CompletedProcess(w.args, w.returncode, out, err))
        r = cli("rounds", "--address", fed.address, "--json")
        assert r.returncode == 0, r.stderr
        yield FinishedRun(fed, state, json.loads(r.stdout), metrics_port, *done)
    finally:
        fed.stop()


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def pixels(path: Path) -> Any:
    import matplotlib.image

    return matplotlib.image.imread(str(path))


def md_table(text: str, heading: str) -> list[dict[str, str]]:
    """The first markdown table under `## heading`, as dicts keyed by its header."""
    lines = text.split(f"## {heading}\n", 1)[1].splitlines()
    end = next((i for i, ln in enumerate(lines) if ln.startswith("## ")), len(lines))
    rows = [ln for ln in lines[:end] if ln.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in row.strip("|").split("|")), strict=True))
            for row in rows[2:]]


def num(cell: str) -> float | None:
    return None if cell == "-" else float(cell)


def close(cell: str, value: float | None, places: int = 4) -> bool:
    if value is None:
        return cell == "-"
    return abs(float(cell) - value) <= 0.6 * 10 ** -places


def check_report(out: Path, rounds: dict[str, Any]) -> str:
    for name in PLOTS:
        width, height = png_size(out / name)
        # Real figures at 100 dpi are hundreds of pixels; a blank or failed save is not.
        assert width >= 600 and height >= 300, (name, width, height)
        assert (out / name).stat().st_size > 10_000, name
        img = pixels(out / name)
        assert img.std() > 0.05, f"{name} is blank"
    text = (out / "summary.md").read_text()
    assert f"fedgpu run {rounds['run_id']}" in text
    table = md_table(text, "Rounds")
    assert [int(r["round"]) for r in table] == [r["round"] for r in rounds["rounds"]]
    for row, rec in zip(table, rounds["rounds"], strict=True):
        assert row["status"] == rec["status"]
        assert int(row["nodes"]) == rec["nodes_reporting"]
        assert close(row["train loss"], rec["train_loss"])
        assert close(row["eval loss"], rec["eval"]["loss"])
        assert close(row["accuracy"], rec["eval"]["accuracy"])
        assert close(row["duration s"], rec["duration_s"])
        assert close(row["aggregation s"], rec["aggregation_s"])
        slowest = max(u["resources"]["train_seconds"] for u in rec["updates"])
        assert close(row["training s"], slowest)
        assert close(row["upload s"], max(u["upload_s"] for u in rec["updates"]))
        assert int(row["bytes"]) == rec["bytes_received"]
    nodes = md_table(text, "Nodes")
    expected = [(r["round"], u["node"], u) for r in rounds["rounds"] for u in r["updates"]]
    assert len(nodes) == len(expected)
    for row, (rnd, name, upd) in zip(nodes, expected, strict=True):
        assert (int(row["round"]), row["node"]) == (rnd, name)
        assert row["device"] == "cpu"
        assert int(row["rss peak MiB"]) == upd["resources"]["rss_peak_mib"]
        assert row["gpu peak MiB"] == "-"  # CPU nodes: no NVML figures
        per_node = {e["node"]: e for e in next(
            r for r in rounds["rounds"] if r["round"] == rnd)["eval"]["per_node"]}
        assert close(row["accuracy"], per_node[name]["metrics"]["accuracy"])
    return text


def test_round_record_has_time_split(finished_run: FinishedRun) -> None:
    for rec in finished_run.rounds["rounds"]:
        # The aggregator really did work and really received uploads in every round.
        assert 0 < rec["aggregation_s"] < rec["duration_s"]
        for u in rec["updates"]:
            assert 0 < u["upload_s"] < rec["duration_s"]


def test_report_from_live_aggregator_and_checkpoint(finished_run: FinishedRun,
                                                    tmp_path: Path) -> None:
    live = cli("report", "--address", finished_run.fed.address, "--out", str(tmp_path / "live"))
    assert live.returncode == 0, live.stderr
    assert {Path(p).name for p in live.stdout.split()} == {*PLOTS, "summary.md"}
    live_text = check_report(tmp_path / "live", finished_run.rounds)

    saved = cli("report", "--state-dir", str(finished_run.state_dir), "--out",
                str(tmp_path / "saved"), token=None)
    assert saved.returncode == 0, saved.stderr
    saved_text = check_report(tmp_path / "saved", finished_run.rounds)
    # Same run, same numbers: only the "Source:" line differs.
    strip = [ln for ln in live_text.splitlines() if not ln.startswith("Source:")]
    assert strip == [ln for ln in saved_text.splitlines() if not ln.startswith("Source:")]


def test_plots_follow_the_numbers(finished_run: FinishedRun, tmp_path: Path) -> None:
    doc = finished_run.rounds
    first = tmp_path / "a.json"
    first.write_text(json.dumps(doc))
    # A second "run" whose model did far worse and whose rounds took twice as long.
    other = json.loads(json.dumps(doc))
    for rec in other["rounds"]:
        rec["eval"]["accuracy"] = rec["eval"]["accuracy"] / 3
        rec["train_loss"] = rec["train_loss"] * 2
        rec["duration_s"] = rec["duration_s"] * 2
    second = tmp_path / "b.json"
    second.write_text(json.dumps(other))
    for src, out in ((first, "a"), (second, "b")):
        r = cli("report", "--rounds-json", str(src), "--out", str(tmp_path / out))
        assert r.returncode == 0, r.stderr
    check_report(tmp_path / "a", doc)
    changed = {"global.png", "round_time.png"}
    for name in PLOTS:
        a, b = pixels(tmp_path / "a" / name), pixels(tmp_path / "b" / name)
        assert a.shape == b.shape
        assert (a != b).any() == (name in changed), name
    b_rows = md_table((tmp_path / "b" / "summary.md").read_text(), "Rounds")
    for row, rec in zip(b_rows, other["rounds"], strict=True):
        assert close(row["accuracy"], rec["eval"]["accuracy"])


def test_report_refuses_bad_sources(tmp_path: Path) -> None:
    r = cli("report", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "exactly one source" in r.stderr
    r = cli("report", "--out", str(tmp_path / "x"), "--state-dir", str(tmp_path),
            "--rounds-json", str(tmp_path / "r.json"))
    assert r.returncode == 2 and "--state-dir and --rounds-json" in r.stderr
    r = cli("report", "--out", str(tmp_path / "x"), "--state-dir", str(tmp_path))
    assert r.returncode == 2 and "holds no checkpoint" in r.stderr
    (tmp_path / "empty.json").write_text(json.dumps({"run_id": "abc", "rounds": []}))
    r = cli("report", "--out", str(tmp_path / "x"), "--rounds-json", str(tmp_path / "empty.json"))
    assert r.returncode == 1 and "no finished round" in r.stderr
    for bad in (r,):
        assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


# ---- metrics --------------------------------------------------------------------------


def scrape(port: int, path: str = "/metrics") -> tuple[int, str, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_after_a_run(finished_run: FinishedRun) -> None:
    import grpc

    from fedgpu.core.transport import token_metadata
    from fedgpu.proto import pb, pb_grpc

    fed, rounds = finished_run.fed, finished_run.rounds["rounds"]
    # A forged update (unknown node id): refused, and counted by reason.
    with grpc.insecure_channel(fed.address) as ch:
        header = pb.UpdateHeader(node_id="forged-node", round=1, task_id="x")
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.FederationStub(ch).PushUpdate(
                iter([pb.UpdateChunk(header=header)]), metadata=token_metadata(fed.token),
                timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

    status = fed.query("GetStatus")
    # Asked before the scrape: the nodes have left, so their last-seen age only grows.
    nodes = {n["name"]: n for n in fed.query("ListNodes")["nodes"]}
    code, ctype, text = scrape(finished_run.metrics_port)
    assert code == 200 and ctype.startswith("text/plain; version=0.0.4")
    m = samples(text)
    assert m[("fedgpu_info", (("mode", "star"), ("run_id", status["run_id"]),
                              ("strategy", "fedavg"), ("task", "digits"),
                              ("version", status["version"])))] == 1
    assert m[("fedgpu_run_state", (("state", "finished"),))] == 1
    assert m[("fedgpu_run_state", (("state", "running"),))] == 0
    assert m[("fedgpu_round", ())] == 3 == status["round"]
    assert m[("fedgpu_rounds_total", ())] == 3
    assert m[("fedgpu_round_attempts_total", (("status", "finished"),))] == 3
    assert m[("fedgpu_updates_accepted_total", ())] == sum(len(r["updates"]) for r in rounds)
    assert m[("fedgpu_received_bytes_total", ())] == sum(r["bytes_received"] for r in rounds)
    assert m[("fedgpu_aggregation_seconds_total", ())] == pytest.approx(
        sum(r["aggregation_s"] for r in rounds))
    assert m[("fedgpu_last_round_duration_seconds", ())] == rounds[-1]["duration_s"]
    assert m[("fedgpu_eval_accuracy", ())] == pytest.approx(status["accuracy"])
    assert status["rejections"] == {"unknown_node": 1}
    assert m[("fedgpu_updates_rejected_total", (("reason", "unknown_node"),))] == 1
    # GPU-hours: each site's device-seconds, as its updates reported them (one device each).
    device_s = fed.query("ListRounds")["device_seconds"]["per_site"]
    assert device_s and all(s > 0 for s in device_s.values())
    for site, seconds in device_s.items():
        assert seconds == pytest.approx(sum(u["resources"]["device_seconds"] for r in rounds
                                            for u in r["updates"] if u["node"] == site))
        assert m[("fedgpu_device_seconds_total", (("job_id", status["job_id"]),
                                                  ("site", site)))] == pytest.approx(seconds)
    assert m[("fedgpu_nodes_registered", ())] == 2
    for name, node in nodes.items():
        assert m[("fedgpu_node_rounds_completed_total", (("node", name),))] == 3
        assert m[("fedgpu_node_last_seen_seconds", (("node", name),))] >= node["last_seen_s"]
        assert m[("fedgpu_node_rss_peak_mib", (("node", name),))] == node["last_resources"][
            "rss_peak_mib"]
        assert m[("fedgpu_node_uses_gpu", (("node", name),))] == 0
        # CPU nodes: no NVML figures, so no GPU memory series rather than zeros.
        assert not [k for k in m if k[0] == "fedgpu_node_gpu_memory_used_mib"
                    and ("node", name) in k[1]]
    assert m[("process_resident_memory_bytes", ())] > 10 << 20
    assert scrape(finished_run.metrics_port, "/")[0] == 404


def test_metrics_port_in_use(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = cli("server", "start", "--job", str(write_job(tmp_path / "job.toml")), "--host",
                "127.0.0.1", "--port", str(free_port()), "--metrics-port", str(port))
    assert r.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in r.stderr
    assert "Traceback" not in r.stderr


# ---- status --watch -------------------------------------------------------------------


def test_watch_follows_the_run_to_its_end(finished_run: FinishedRun) -> None:
    w, rounds = finished_run.watch, finished_run.rounds
    assert w.returncode == 0, w.stderr
    lines = w.stdout.splitlines()
    assert f"run {rounds['run_id']}  state waiting" in lines[0]
    finished = [ln for ln in lines if re.match(r"round \d/3 finished", ln)]
    assert [ln.split()[1] for ln in finished] == ["1/3", "2/3", "3/3"]
    for rec in rounds["rounds"]:
        # Each round's evaluation is shown once, at the precision the watcher prints.
        acc = f"{rec['eval']['accuracy']:.4f}"
        assert lines.count(f"round {rec['round']} global model: accuracy {acc}, loss "
                           f"{rec['eval']['loss']:.4f} on 2 nodes") == 1
        line = next(ln for ln in finished if ln.startswith(f"round {rec['round']}/"))
        assert f"train loss {rec['train_loss']:.4f}" in line
    assert "state running -> finished" in lines
    assert lines[-1].startswith(f"run {rounds['run_id']} finished: round 3/3")

    docs = [json.loads(ln) for ln in finished_run.watch_json.stdout.splitlines()]
    assert finished_run.watch_json.returncode == 0
    assert docs[0]["state"] == "waiting" and docs[-1]["state"] == "finished"
    assert [d["round"] for d in docs] == sorted(d["round"] for d in docs)
    assert {d["round"] for d in docs} >= {0, 3}
    assert all(d["run_id"] == rounds["run_id"] for d in docs)


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_watch_stops_on_ctrl_c(federation: Federation, tmp_path: Path, inherited: str) -> None:
    import signal

    from tests.fixtures.processes import with_signals

    # Started with SIGINT at its default and, as a script's `cmd &` leaves it, ignored: the
    # watch installs its own handler, so the result does not depend on how pytest was started.
    federation.start_server(write_job(tmp_path / "job.toml"))
    cmd = [*FEDGPU, "status", "--address", federation.address, "--watch"]
    w = subprocess.Popen(with_signals(cmd, **{inherited: (signal.SIGINT,)}),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=base_env(FEDGPU_TOKEN=federation.token), cwd=ROOT)
    # The first status block says the watcher is in its loop.
    assert w.stdout is not None and "state waiting" in w.stdout.readline()
    w.send_signal(signal.SIGINT)
    out, err = w.communicate(timeout=30)
    assert w.returncode == 130 and "Traceback" not in err


def test_watch_unreachable(tmp_path: Path) -> None:
    r = cli("status", "--address", f"127.0.0.1:{free_port()}", "--watch")
    assert r.returncode == 1 and "cannot reach aggregator" in r.stderr and r.stdout == ""
