"""`fedgpu report`: PNG plots and a markdown summary of a run's round history.

The history is the `fedgpu rounds --json` document, from a live aggregator, an aggregator's
state directory (its job database; a `state.json` of an older version held the history
itself), or the `rounds.json` that `fedgpu run` leaves behind. matplotlib is
imported only when plotting, so the CLI (and the aggregator image, which lacks it) loads fast.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedgpu.cli.common.ids import unique_prefix
from fedgpu.cli.common.output import fmt_value
from fedgpu.cli.report import cross_site
from fedgpu.core.cross_site_matrix import matrix
from fedgpu.core.errors import ConfigError, FedgpuError

PLOTS = ("global.png", "node_accuracy.png", "node_memory.png", "round_time.png")
SUMMARY = "summary.md"
# Beyond this many nodes the per-node panels stop being readable; the summary keeps them all.
MAX_NODE_PANELS = 12


@dataclass
class RunHistory:
    source: str
    run_id: str | None
    initial_eval: dict[str, Any] | None
    rounds: list[dict[str, Any]]


def from_rounds_doc(doc: Mapping[str, Any], source: str) -> RunHistory:
    # state.json keeps the same records under "history".
    rounds = doc.get("rounds", doc.get("history"))
    if not isinstance(rounds, list):
        raise ConfigError(f"{source} has no round history (neither 'rounds' nor 'history'): "
                          "give the rounds.json of a run, or a state directory")
    return RunHistory(source, doc.get("run_id"), doc.get("initial_eval"), rounds)


def load_json_file(path: Path) -> RunHistory:
    return from_rounds_doc(_json_object(path), str(path))


def _json_object(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path} as JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return doc


def load_state_dir(directory: Path, job: str = "") -> RunHistory:
    """A job's history from its checkpoint: `directory` is one job's (it holds state.json)
    or the aggregator's --state-dir, whose jobs/ID/ holds each job's (`job`, else the job
    checkpointed last)."""
    state = directory / "state.json"
    if not state.exists() or job:
        found = list((directory / "jobs").glob("*/state.json"))
        if job and found:
            # An id, or its first characters, as everywhere a job id is taken.
            job = unique_prefix(job, (p.parent.name for p in found))
        found = sorted((p for p in found if not job or p.parent.name == job),
                       key=lambda p: p.stat().st_mtime)
        if not found:
            raise ConfigError(
                f"{directory} holds no checkpoint{f' of job {job}' if job else ''}: give the "
                "aggregator's --state-dir (a run of `fedgpu run` keeps it in runs/<time>/state)")
        state = found[-1]
    doc = _json_object(state)
    if "history" in doc:  # a state.json from before the history moved into the job database
        return from_rounds_doc(doc, str(state))
    # The checkpoint holds weights and engine state; the history is in the job database of
    # the state directory (<state dir>/jobs/<job id>/state.json), read without writing it.
    from fedgpu.server.jobs.store import read_history

    state_dir, job_id = state.parent.parent.parent, state.parent.name
    saved = read_history(state_dir, job_id)
    if saved is None:
        raise ConfigError(f"{state} has no round history in {state_dir}/fedgpu.db (job "
                          f"{job_id}): give the aggregator's --state-dir as it was written")
    saved = saved.upto(int(doc.get("global_round") or 0))
    return RunHistory(f"{state_dir} (job {job_id})", doc.get("run_id"), saved.initial_eval,
                      saved.records)


def load_aggregator(address: str, token: str | None, tls: Any = None,
                    job: str = "") -> RunHistory:
    from fedgpu.core import admin_client

    doc = admin_client.query(address, token, "ListRounds", tls=tls, job_id=job)
    return from_rounds_doc(doc, f"aggregator {address}")


# ---- numbers --------------------------------------------------------------------------


def _max(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def round_rows(hist: RunHistory) -> list[dict[str, Any]]:
    """One row per recorded round attempt; the time split is documented in
    docs/reference/json.md."""
    rows = []
    for r in hist.rounds:
        updates = r.get("updates") or []
        ev = r.get("eval") or {}
        # The round lasts as long as its slowest node, so the split uses the slowest one.
        training = _max([(u.get("resources") or {}).get("train_seconds") for u in updates])
        upload = _max([u.get("upload_s") for u in updates])
        aggregation = r.get("aggregation_s")
        duration = r.get("duration_s")
        known = [v for v in (training, upload, aggregation) if v is not None]
        other = None if duration is None else max(0.0, duration - sum(known))
        rows.append({
            "round": r["round"],
            "attempt": r.get("attempt", 1),
            "status": r.get("status", "finished"),
            "nodes": r.get("nodes_reporting", len(updates)),
            "train_loss": r.get("train_loss"),
            "eval_loss": ev.get("loss"),
            "accuracy": ev.get("accuracy"),
            "duration_s": duration,
            "training_s": training,
            "upload_s": upload,
            "aggregation_s": aggregation,
            "other_s": other,
            "bytes_received": r.get("bytes_received"),
        })
    return rows


def node_rows(hist: RunHistory) -> list[dict[str, Any]]:
    """One row per (finished round, node): the global model's accuracy on the node's held-out
    split after that round, and the node's memory during it."""
    rows = []
    for r in hist.rounds:
        if r.get("status", "finished") != "finished":
            continue
        per_node = {e.get("node"): e for e in ((r.get("eval") or {}).get("per_node") or [])
                    if isinstance(e, dict)}
        for u in r.get("updates") or []:
            res = u.get("resources") or {}
            ev = (per_node.get(u.get("node")) or {}).get("metrics") or {}
            rows.append({
                "round": r["round"],
                "node": u.get("node"),
                "device": res.get("device") or "?",
                "accuracy": ev.get("accuracy"),
                "train_accuracy": (u.get("train_metrics") or {}).get("accuracy"),
                "mem_before_mib": res.get("nvml_used_before_mib"),
                "mem_peak_mib": res.get("nvml_used_peak_mib"),
                "mem_after_mib": res.get("nvml_used_after_mib"),
                "rss_peak_mib": res.get("rss_peak_mib"),
                "train_s": res.get("train_seconds"),
                "upload_s": u.get("upload_s"),
            })
    return rows


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(fmt_value(c) for c in row) + " |" for row in rows]
    return out


def summary_markdown(hist: RunHistory, rounds: list[dict[str, Any]],
                     nodes: list[dict[str, Any]], plots: Sequence[str]) -> str:
    finished = [r for r in rounds if r["status"] == "finished"]
    last = next((r for r in reversed(finished) if r["accuracy"] is not None), None)
    init = hist.initial_eval or {}
    lines = [
        f"# fedgpu run {hist.run_id or '?'}",
        "",
        f"Source: {hist.source}",
        "",
        f"- rounds finished: {len(finished)} (attempts recorded: {len(rounds)})",
        f"- initial accuracy: {fmt_value(init.get('accuracy'))}, "
        f"loss {fmt_value(init.get('loss'))}",
        f"- final accuracy: {fmt_value(last and last['accuracy'])}, "
        f"loss {fmt_value(last and last['eval_loss'])} "
        f"(after round {fmt_value(last and last['round'])})",
        f"- total round time: {fmt_value(sum(r['duration_s'] or 0.0 for r in rounds), 3)} s",
        f"- bytes received: {sum(r['bytes_received'] or 0 for r in rounds)}",
        "",
        "## Rounds",
        "",
        "Times in seconds: training = the slowest node's training, upload = the slowest "
        "upload as the aggregator received it, aggregation = the strategy's work, other = "
        "the rest of the round (task download, process start, evaluation, waiting).",
        "",
        *_table(
            ("round", "attempt", "status", "nodes", "train loss", "eval loss", "accuracy",
             "duration s", "training s", "upload s", "aggregation s", "other s", "bytes"),
            [(r["round"], r["attempt"], r["status"], r["nodes"], r["train_loss"],
              r["eval_loss"], r["accuracy"], r["duration_s"], r["training_s"], r["upload_s"],
              r["aggregation_s"], r["other_s"], r["bytes_received"]) for r in rounds]),
        "",
        "## Nodes",
        "",
        "accuracy = the global model after the round, on the node's held-out split; memory in "
        "MiB (NVML before/peak/after on GPU nodes, the training process's peak RSS on CPU).",
        "",
        *_table(
            ("round", "node", "device", "accuracy", "train accuracy", "gpu before MiB",
             "gpu peak MiB", "gpu after MiB", "rss peak MiB", "train s", "upload s"),
            [(n["round"], n["node"], n["device"], n["accuracy"], n["train_accuracy"],
              n["mem_before_mib"], n["mem_peak_mib"], n["mem_after_mib"], n["rss_peak_mib"],
              n["train_s"], n["upload_s"]) for n in nodes]),
        "",
        "## Plots",
        "",
        *[f"![{p}]({p})" for p in plots],
        "",
    ]
    return "\n".join(lines)


# ---- plots ----------------------------------------------------------------------------


def _nan(v: Any) -> float:
    return math.nan if v is None else float(v)


def _plot_global(plt: Any, hist: RunHistory, rounds: list[dict[str, Any]], path: Path) -> None:
    fin = [r for r in rounds if r["status"] == "finished"]
    xs = [r["round"] for r in fin]
    init = hist.initial_eval or {}
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4.5))
    ax_loss.plot(xs, [_nan(r["train_loss"]) for r in fin], "o-", label="training loss")
    ax_loss.plot([0, *xs], [_nan(init.get("loss")), *(_nan(r["eval_loss"]) for r in fin)],
                 "s--", label="federated eval loss")
    ax_loss.set(title="Global loss", xlabel="round", ylabel="loss")
    ax_loss.legend()
    ax_acc.plot([0, *xs], [_nan(init.get("accuracy")), *(_nan(r["accuracy"]) for r in fin)],
                "o-", color="tab:green", label="federated eval accuracy")
    ax_acc.set(title="Global accuracy", xlabel="round", ylabel="accuracy")
    ax_acc.legend()
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    _save(fig, path)


def _by_node(nodes: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for n in nodes:
        out.setdefault(str(n["node"]), []).append(n)
    return dict(sorted(out.items()))


def _plot_node_accuracy(plt: Any, nodes: list[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, rows in list(_by_node(nodes).items())[:MAX_NODE_PANELS * 4]:
        ax.plot([r["round"] for r in rows], [_nan(r["accuracy"]) for r in rows], "o-",
                label=name)
    ax.set(title="Global model accuracy on each node's held-out data", xlabel="round",
           ylabel="accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    _save(fig, path)


def _plot_node_memory(plt: Any, nodes: list[dict[str, Any]], path: Path) -> None:
    groups = list(_by_node(nodes).items())[:MAX_NODE_PANELS]
    cols = min(3, max(1, len(groups)))
    nrows = max(1, math.ceil(len(groups) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, (name, rows) in zip(axes.flat, groups, strict=False):
        xs = [r["round"] for r in rows]
        if any(r["mem_peak_mib"] is not None for r in rows):
            for key, style, label in (("mem_before_mib", "s--", "before"),
                                      ("mem_peak_mib", "o-", "peak"),
                                      ("mem_after_mib", "^:", "after")):
                ax.plot(xs, [_nan(r[key]) for r in rows], style, label=f"GPU {label}")
            ax.set_ylabel("GPU memory used (MiB)")
        else:
            ax.plot(xs, [_nan(r["rss_peak_mib"]) for r in rows], "o-", color="tab:purple",
                    label="peak RSS (CPU)")
            ax.set_ylabel("MiB")
        # From zero: a 1 MiB wobble must not look like a leak.
        ax.set_ylim(bottom=0)
        ax.set(title=name, xlabel="round")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("Memory per node and round")
    _save(fig, path)


def _plot_round_time(plt: Any, rounds: list[dict[str, Any]], path: Path) -> None:
    labels = [f"{r['round']}" + (f".{r['attempt']}" if r["attempt"] != 1 else "")
              for r in rounds]
    xs = list(range(len(rounds)))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = [0.0] * len(rounds)
    for key, label in (("training_s", "training"), ("upload_s", "upload"),
                       ("aggregation_s", "aggregation"), ("other_s", "other")):
        vals = [r[key] or 0.0 for r in rounds]
        ax.bar(xs, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xticks(xs, labels)
    ax.set(title="Round duration", xlabel="round", ylabel="seconds")
    ax.legend()
    _save(fig, path)


def _save(fig: Any, path: Path) -> None:
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    fig.clf()


def write_report(hist: RunHistory, out: Path) -> list[Path]:
    rounds = round_rows(hist)
    if not any(r["status"] == "finished" for r in rounds):
        raise FedgpuError(f"{hist.source}: run {hist.run_id or '?'} has no finished round yet; "
                          "nothing to plot (try again after round 1)")
    try:
        import matplotlib
    except ImportError:
        raise FedgpuError("fedgpu report needs matplotlib: pip install 'fedgpu[report]'"
                          ) from None
    # Agg: no display on servers, and no GUI toolkit import.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FedgpuError(f"cannot create --out {out}: {exc.strerror}") from None
    nodes = node_rows(hist)
    paths = [out / name for name in PLOTS]
    _plot_global(plt, hist, rounds, paths[0])
    _plot_node_accuracy(plt, nodes, paths[1])
    _plot_node_memory(plt, nodes, paths[2])
    _plot_round_time(plt, rounds, paths[3])
    plt.close("all")
    summary = out / SUMMARY
    text = summary_markdown(hist, rounds, nodes, PLOTS)
    # A cross-site job: its site x model matrix too (fedgpu/cli/report/cross_site.py).
    if (m := matrix(hist.rounds)) is not None and m["rows"]:
        paths.append(out / cross_site.PLOT)
        cross_site.plot(plt, m, paths[-1])
        text += "\n".join(["", *cross_site.markdown(m), f"![{cross_site.PLOT}]({cross_site.PLOT})",
                            ""])
    summary.write_text(text)
    return [*paths, summary]
