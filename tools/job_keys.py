"""The job file's keys for the docs site, read from fedgpu/core/config.py's `Job` dataclass.

Each key's type and default are the dataclass field's; its description is the comment above
the field in config.py (or, for a field the code leaves uncommented, a line in DESCRIPTIONS
below). A field that is a dataclass itself (`resources`, and the tables other features add)
is a TOML table and gets a table of its own. tools/docs_hooks.py puts the result into
docs/reference/job-file.md at build time; tests/docs/test_reference.py fails when a field has
no description, so a new key cannot be left undocumented.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import sys
import textwrap
import typing
from typing import Any

# Fields whose line in config.py carries no comment, or a comment written for the code's
# reader rather than the job file's: these words win over the comment.
DESCRIPTIONS: dict[str, str] = {
    "Job.rounds": "Training rounds (in ring mode: blocks of iterations).",
    "Job.min_nodes": "A round needs this many registered nodes that can take the job, and "
                     "closes with at least this many updates (in ring mode: the ring's size).",
    "Job.fraction": "Share of the live, eligible nodes sampled each round (seeded, "
                    "reproducible); must stay 1.0 in ring mode.",
    "Job.round_deadline_s": "Stragglers past this many seconds are dropped from the round; "
                            "too few updates by then and the round is retried.",
    "Job.use_gpu": "Short form of `[resources] gpu`: false is `gpu = \"none\"`; true leaves "
                   "`gpu` at `\"preferred\"` unless `[resources]` says otherwise.",
    "Job.strategy": "How updates are combined: `fedavg`, `fedavgm`, `fedadam`, `median`, "
                    "`trimmed_mean`, `fednova` (see [strategies](#strategies)).",
    "Job.strategy_params": "The strategy's parameters (see [strategies](#strategies)).",
    "Job.hyperparameters": "Passed to the task as JSON (numbers, strings, booleans); the "
                           "runner takes its own keys out first (see "
                           "[the runner's hyperparameters](tasks.md#the-runners-hyperparameters)).",
    "Job.seed": "Seeds the sampling of nodes and the task's initialisation.",
    "Job.mode": "`star` (the aggregator combines updates), `ring` (D-PSGD between the "
                "nodes; see [Train as a ring](../how-to/ring.md)) or `async` (FedBuff: a step "
                "per buffer of updates; see [Unlike sites](../how-to/heterogeneous-sites.md)).",
    "Job.evaluate": "Federated evaluation of every global model on the nodes' held-out splits.",
    "Job.initial_weights": "A safetensors file to start from; else one node builds the "
                           "task's initial model.",
    "Job.mixing": "Ring mode: `\"uniform\"` (left, self, right, 1/3 each) or an explicit "
                  "`min_nodes` x `min_nodes` doubly stochastic matrix W (row r: rank r's weights).",
    "Job.local_steps": "Ring mode: gradient steps between two gossip exchanges.",
    "Job.iterations": "Ring mode: gradient steps per node in all, split evenly over `rounds` "
                      "blocks.",
    "Job.ring_timeout_s": "Ring mode: every rendezvous and every exchange gives up after this.",
    "Job.resources": "What a node's GPU must offer for the job.",
    "Job.task_dir": "A task bundle directory, relative to the job file: `fedgpu job submit` "
                    "packs it and sends it with the job (`--task-dir` wins). The aggregator "
                    "keeps the bundle, not the path.",
    "Job.privacy": "Client-level differential privacy: clipping, noise, the accountant and a "
                   "budget that ends the job (see [Train with differential privacy]"
                   "(../how-to/differential-privacy.md)); absent: none.",
    "Resources.gpu": "`required`, `preferred` or `none` (see [GPU-aware admission]"
                     "(../explanation/gpu-policy.md#gpu-aware-admission-resources)).",
}


def _comments(cls: type) -> dict[str, str]:
    """The comment lines right above each field of `cls`, joined."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    (node,) = ast.parse(source).body
    found: dict[str, str] = {}
    for stmt in node.body:  # type: ignore[attr-defined]
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above: list[str] = []
        i = stmt.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#"):
            above.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        if above:
            found[stmt.target.id] = " ".join(above)
    return found


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " \\| ".join(f'`"{m.value}"`' for m in tp)
    text = getattr(tp, "__name__", None) if isinstance(tp, type) else None
    text = text or str(tp).replace("typing.", "")
    return f"`{text.replace('NoneType', 'None').replace('|', '/')}`"


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
        if dataclasses.is_dataclass(value):
            return "see below"
    else:
        return "required"
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if value == {}:
        return "empty"
    return f"`{value}`"


def _flat(f: dataclasses.Field[Any]) -> bool:
    """A dataclass field whose keys sit at the top level of the file, not in a table of
    their own (`metadata={"flat": True}`: the heterogeneous-sites keys, `Job.hetero`)."""
    return bool(f.metadata.get("flat"))


def rows(cls: type) -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) per field of `cls`; '' where no description."""
    hints = typing.get_type_hints(cls)
    comments = _comments(cls)
    out: list[tuple[str, str, str, str]] = []
    for f in dataclasses.fields(cls):
        if _flat(f):
            out += rows(hints[f.name])
            continue
        out.append((f.name, _type_name(hints[f.name]), _default(f),
                    DESCRIPTIONS.get(f"{cls.__name__}.{f.name}") or comments.get(f.name, "")))
    return out


def tables(cls: type | None = None) -> list[tuple[str, type]]:
    """(TOML table, dataclass) for the job and every table in it, the job first."""
    from fedgpu.core.config import Job

    cls = cls or Job
    out: list[tuple[str, type]] = [("", cls)]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        # An optional table (`[privacy]`: absent means none) is a table all the same.
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            tp = args[0]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp) and not _flat(f):
            out.append((f.name, tp))
    return out


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown(heading: str = "###") -> str:
    out: list[str] = []
    for table, cls in tables():
        title = "Top-level keys" if not table else f"`[{table}]`"
        out += [f"{heading} {title}", ""]
        out += ["| key | type | default | what it does |", "|---|---|---|---|"]
        for key, tp, default, text in rows(cls):
            if table == "" and any(key == t for t, _ in tables()[1:]):
                text = text or ""
                text = f"{text} The table `[{key}]`, below.".strip()
            out.append(f"| `{key}` | {tp} | {default} | {_cell(text)} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(markdown() + "\n")
