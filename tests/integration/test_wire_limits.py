"""Strings, maps and numbers from the wire, sent as an attacker would, against a real
aggregator: every one is bounded, no log line can be forged, every `--json` document stays
strict JSON and every admin reply fits in a gRPC message."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from fedgpu.core import codec
from fedgpu.proto import pb, pb_grpc
from tests.fixtures.federation import Federation, cli, job_dir, write_job
from tests.fixtures.wire import Probe, update

GLOBAL = {"w": np.zeros(16, np.float32)}
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "state" / "star-v0.json"


def strict(text: str) -> Any:
    """json.loads that refuses NaN and Infinity, as jq or JSON.parse would."""
    def refuse(name: str) -> None:
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def start(fed: Federation, tmp: Path, *flags: str, **job: Any) -> Any:
    init = tmp / "init.safetensors"
    init.write_bytes(codec.encode(GLOBAL).to_bytes())
    spec: dict[str, Any] = dict(rounds=1, min_nodes=1, round_deadline_s=120, evaluate=False,
                                round_retries=0, initial_weights=str(init))
    spec.update(job)
    return fed.start_server(write_job(tmp / "job.toml", **spec), *flags)


def run(fed: Federation, body: Any) -> Any:
    async def go() -> Any:
        async with grpc.aio.insecure_channel(fed.address) as ch:
            return await body(pb_grpc.FederationStub(ch))
    return asyncio.run(go())


def test_names_and_labels_are_bounded_and_cannot_forge_log_lines(
        federation: Federation, tmp_path: Path) -> None:
    server = start(federation, tmp_path, min_nodes=2)
    forged = "site-a\n2026-01-01 00:00:00,000 INFO    fedgpu.server: \x1b[32mall good\x1b[0m"
    refused: list[tuple[str, grpc.StatusCode, str]] = []

    async def attack(stub: pb_grpc.FederationStub) -> list[str]:
        async def try_register(label: str, name: str, **fields: Any) -> None:
            try:
                await Probe(stub, federation.token).register(name, **fields)
            except grpc.aio.AioRpcError as exc:
                refused.append((label, exc.code(), exc.details()))
        await try_register("newline", forged)
        await try_register("long name", "n" * 129)
        await try_register("10k labels", "site-b", labels={f"k{i}": "v" * 100
                                                           for i in range(10_000)})
        await try_register("33 labels", "site-b", labels={f"k{i}": "v" for i in range(33)})
        await try_register("long label", "site-b", labels={"k": "v" * 257})
        await try_register("nan fraction", "site-b",
                           decision=pb.GpuDecision(memory_fraction=float("nan")))
        # The largest registration allowed, 40 times under one name: one node, not 40.
        big = {f"label-{i:02d}": "x" * 256 for i in range(32)}
        ids = [(await Probe(stub, federation.token).register("site-c", labels=big)).node_id
               for _ in range(40)]
        return ids

    ids = run(federation, attack)
    codes = {label: (code, details) for label, code, details in refused}
    assert set(codes) == {"newline", "long name", "10k labels", "33 labels", "long label",
                          "nan fraction"}
    assert all(code == grpc.StatusCode.INVALID_ARGUMENT for code, _ in codes.values())
    assert "node_name 'site-a\\n2026" in codes["newline"][1]
    assert "control or non-printable characters" in codes["newline"][1]
    assert "10000 labels; at most 32" in codes["10k labels"][1]
    assert "memory_fraction is nan" in codes["nan fraction"][1]
    log = server.text()
    # The refusal is logged with the name escaped: no escape sequence, no line of its own.
    assert "\x1b" not in log
    assert not any(line.startswith("2026-01-01") for line in log.splitlines())
    nodes = federation.query("ListNodes")["nodes"]
    assert [n["node_id"] for n in nodes] == [ids[-1]]
    assert len(set(ids)) == 40


def test_failure_text_is_truncated_and_metrics_must_be_finite(
        federation: Federation, tmp_path: Path) -> None:
    start(federation, tmp_path, "--state-dir", str(tmp_path / "state"), min_nodes=2)
    error = "E" * (9 << 20)

    async def attack(stub: pb_grpc.FederationStub) -> dict[str, Any]:
        a, b = [await Probe(stub, federation.token).register(n) for n in ("a", "b")]
        ta, tb = [await p.task() for p in (a, b)]
        out: dict[str, Any] = {"failure": await a.push(a.header(ta, failed=True, error=error))}
        enc, chunks = update({"w": np.ones(16, np.float32)})
        for label, value in (("nan", float("nan")), ("inf", float("-inf"))):
            out[label] = await b.push(b.header(tb, enc, train_metrics={"loss": value}), chunks)
        return out

    out = run(federation, attack)
    assert isinstance(out["failure"], pb.PushReply)
    for label in ("nan", "inf"):
        assert out[label].code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "update rejected (non_finite): train_metrics['loss'] is" in out[label].details()
    # Nothing usable arrived: the round (no retries) and so the run failed.
    federation.wait_state(("failed",), timeout=60)
    rounds = cli("rounds", "--json", "--address", federation.address)
    assert rounds.returncode == 0, rounds.stderr
    (rec,) = strict(rounds.stdout)["rounds"]
    (failure,) = rec["failures"]
    assert len(failure["error"]) < 4200
    assert failure["error"].endswith(f"[truncated: {9 << 20} characters in all]")
    assert [(x["reason"], x["node"]) for x in rec["rejected"]] == [("non_finite", "b")] * 2
    assert (job_dir(tmp_path / "state") / "state.json").stat().st_size < 200_000


def test_huge_finite_metrics_stay_finite_in_the_documents(federation: Federation,
                                                    tmp_path: Path) -> None:
    start(federation, tmp_path, min_nodes=2)

    async def attack(stub: pb_grpc.FederationStub) -> list[Any]:
        nodes = [await Probe(stub, federation.token).register(n) for n in ("a", "b")]
        tasks = [await p.task() for p in nodes]
        enc, chunks = update({"w": np.ones(16, np.float32)})
        return [await p.push(p.header(t, enc, train_metrics={"loss": 1e308}), chunks)
                for p, t in zip(nodes, tasks, strict=True)]

    replies = run(federation, attack)
    assert all(isinstance(r, pb.PushReply) for r in replies), replies
    federation.wait_state(("finished",), timeout=60)
    out = cli("rounds", "--json", "--address", federation.address)
    (rec,) = strict(out.stdout)["rounds"]
    # 1e308 is finite; weighted by 5 examples each it used to overflow into Infinity.
    assert rec["train_loss"] == 1e308
    assert [u["train_metrics"]["loss"] for u in rec["updates"]] == [1e308, 1e308]
    status = cli("status", "--json", "--address", federation.address)
    strict(status.stdout)


def test_rounds_fit_in_replies_whatever_the_history(federation: Federation,
                                                    tmp_path: Path) -> None:
    # A state.json as the aggregator wrote it before errors were truncated: 40 rounds with
    # a 1 MiB error each and one with 9 MiB, ~50 MiB of history against a 17 MiB message.
    old = json.loads(FIXTURE.read_text())
    first = old["history"][0]
    history = []
    for i in range(41):
        rec = copy.deepcopy(first)
        rec["round"] = i + 1
        rec["failures"] = [{"node_id": "x", "node": "x",
                            "error": ("F" if i else "N") * ((9 if i == 0 else 1) << 20)}]
        history.append(rec)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    blob = codec.encode(GLOBAL).to_bytes()
    (state_dir / "global-000041.safetensors").write_bytes(blob)
    job = {**old["job"], "rounds": 41}
    (state_dir / "state.json").write_text(json.dumps({
        **old, "job": job, "global_round": 41, "history": history,
        "weights_file": "global-000041.safetensors",
        "weights_sha256": hashlib.sha256(blob).hexdigest()}))
    federation.start_server(write_job(tmp_path / "job.toml", rounds=41, min_nodes=2,
                                      hyperparameters=job["hyperparameters"]),
                            "--state-dir", str(state_dir))
    out = cli("rounds", "--json", "--address", federation.address, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rounds = strict(out.stdout)["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, 42))
    assert all(len(r["failures"][0]["error"]) == 1 << 20 for r in rounds[1:])
    # The one record larger than a reply lists fewer failures and says so.
    assert rounds[0]["failures"] == [] and rounds[0]["failures_not_listed"] == 1
    assert "next_offset" not in strict(out.stdout)
